"""LoRA: train low-rank adapters (peft) on a frozen base model, serve base + merged adapter.

``agentjet-server up --lora-rank R`` (``--lora-alpha``, ``--lora-dropout``, ``--lora-targets``;
``all-linear`` by default, every linear layer but the output head: a small model learns much faster
with the head adapted too, ``--lora-targets all-linear,lm_head``):
the learner wraps its model's linear layers with peft's LoRA modules in place, so the model keeps
its Hugging Face interface (decoder, output head) and the rest of the learner runs unchanged;
only the adapter's parameters get gradients and AdamW state. After each step a vLLM engine in the
server's process gets the adapter alone (``VLLMEngine.update_adapter``: vLLM's LoRA support);
any other engine gets the merged weights, ``W + (B @ A) * alpha / R`` under the base names, and
every token is tagged as before. Checkpoints keep the merged model (loadable as is), the
adapter (``adapter/``, peft's format: loadable by peft and by vLLM's LoRA support) and the
adapter's optimizer state; ``--resume`` rebuilds the base from ``--model`` and loads the adapter.
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


def attach(model: torch.nn.Module, spec: LoraSpec) -> Any:
    """Wrap ``model``'s target layers with LoRA modules (in place; the base weights are frozen)
    and return peft's wrapper."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:
        raise ImportError("--lora-rank needs peft: pip install 'agentjet-server[lora]' (or pip install peft)") from exc
    targets = spec.target_modules(model)
    head: Any = getattr(model, "get_output_embeddings", lambda: None)()
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    head_name = next((name for name, module in model.named_modules() if module is head), None)
    if tied and head_name is not None and head_name.rsplit(".", 1)[-1] in targets:
        raise ValueError(
            f"--lora-targets {spec.targets}: this model's output head shares its weights with the input "
            f"embeddings, so an adapter on {head_name} would change both; leave it out of --lora-targets"
        )
    config = LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,  # type: ignore[arg-type]  # peft annotates int; it divides, floats work
        lora_dropout=spec.dropout,
        target_modules=targets,
        bias="none",
    )
    try:
        return get_peft_model(model, config)
    except ValueError as exc:  # no module matched the targets
        raise ValueError(f"--lora-targets {spec.targets}: {exc}") from exc


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def adapter_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter's tensors of a LoRA-wrapped model's state dict."""
    return {name: tensor for name, tensor in state.items() if is_adapter(name)}


def merged(state: dict[str, torch.Tensor], spec: LoraSpec) -> dict[str, torch.Tensor]:
    """A LoRA-wrapped model's state dict as the plain model's, each adapter folded into its base
    weight: ``W + (B @ A) * scaling`` (computed in fp32, stored in W's dtype)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if is_adapter(name):
            continue
        if ".base_layer." not in name:
            out[name] = tensor
            continue
        layer, _, leaf = name.rpartition(".base_layer.")
        if leaf == "weight":
            a = state[f"{layer}.lora_A.{ADAPTER}.weight"].float()
            b = state[f"{layer}.lora_B.{ADAPTER}.weight"].float()
            tensor = (tensor.float() + (b @ a) * spec.scaling).to(tensor.dtype)
        out[f"{layer}.{leaf}"] = tensor
    return out


def write_adapter(directory: Path, adapter: dict[str, torch.Tensor], spec: LoraSpec, base: str) -> None:
    """``adapter`` in peft's on-disk format (``adapter_model.safetensors``, ``adapter_config.json``)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    tensors = {
        "base_model.model." + name.replace(f".{ADAPTER}.", "."): t.detach().contiguous() for name, t in adapter.items()
    }
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    # the layers that have adapters (what all-linear resolved to)
    targets = sorted({name.split(".lora_A.")[0].rsplit(".", 1)[-1] for name in adapter if ".lora_A." in name})
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
