"""The shape of a causal LM as its config gives it, no weights read: the parameter count (of a model built on
the meta device) and the sizes of its layers. The memory plan (``memory``) estimates from it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs to know about a model: its size and the shape of its layers."""

    parameters: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelShape:
        """Read the config and count the parameters of a model built on the meta device."""
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        config: Any = AutoConfig.from_pretrained(str(path))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
        parameters = sum(p.numel() for p in model.parameters())
        text: Any = getattr(config, "text_config", None) or config
        hidden = int(text.hidden_size)
        heads = int(text.num_attention_heads)
        return cls(
            parameters=parameters,
            hidden=hidden,
            intermediate=int(getattr(text, "intermediate_size", 4 * hidden)),
            layers=int(text.num_hidden_layers),
            heads=heads,
            kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(text, "head_dim", None) or hidden // heads),
            vocab=int(text.vocab_size),
        )
