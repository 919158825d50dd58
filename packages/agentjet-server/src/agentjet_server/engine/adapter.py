"""The LoRA adapter an engine may serve apart from its frozen base: the adapter's spec (``LoraSpec``, as
``--lora-rank``, ``--lora-alpha``, ``--lora-dropout`` and ``--lora-targets`` give it) and its on-disk form
(``write_adapter``: peft's format, which vLLM's LoRA support loads). The learner trains it
(``learner.lora``); checkpoints keep it in the same form.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

ADAPTER = "default"  # peft's name for the one adapter


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float
    dropout: float = 0.0
    # module names (last part: q_proj, ...); ``all-linear`` stands for every linear layer but the
    # output head, and may be combined with names (``all-linear,lm_head``)
    targets: str = "all-linear"

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def target_modules(self, model: torch.nn.Module | None = None) -> list[str]:
        """The module names peft is to wrap; ``all-linear`` resolved against ``model``."""
        names = [t.strip() for t in self.targets.split(",") if t.strip()]
        if "all-linear" in names and model is not None:
            head: Any = getattr(model, "get_output_embeddings", lambda: None)()
            linear = {
                name.rsplit(".", 1)[-1]
                for name, module in model.named_modules()
                if isinstance(module, torch.nn.Linear) and module is not head
            }
            names = sorted(linear) + [n for n in names if n != "all-linear" and n not in linear]
        return names

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def write_adapter(
    directory: Path, adapter: dict[str, torch.Tensor], spec: LoraSpec, base: str, name: str = ADAPTER
) -> None:
    """``adapter`` (the tensors of adapter ``name``) in peft's on-disk format (``adapter_model.safetensors``,
    ``adapter_config.json``): a standalone adapter, loadable on its own."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    tensors = {
        "base_model.model."
        + key.replace(f".lora_A.{name}.", ".lora_A.").replace(f".lora_B.{name}.", ".lora_B."): t.detach().contiguous()
        for key, t in adapter.items()
    }
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    # the layers that have adapters (what all-linear resolved to)
    targets = sorted({key.split(".lora_A.")[0].rsplit(".", 1)[-1] for key in adapter if ".lora_A." in key})
    config = {
        "peft_type": "LORA",
        "base_model_name_or_path": base,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
