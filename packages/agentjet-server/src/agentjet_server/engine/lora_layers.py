"""LoRA layers on a model, through peft: one adapter (``--lora-rank``) or one per agent (``--adapters``).

The learner trains them (``learner.lora``, ``Learner.step(batch, adapter)``) and the transformers engine
serves them (an adapter per agent: each request sampled with its agent's adapter, a mixed batch in one
forward pass), both on the same layers: ``attach`` wraps a model's target layers in place (it keeps its
Hugging Face interface), ``attach_adapters`` puts one adapter per name on it, ``activate`` picks the one
that applies (and alone needs gradients), and ``adapter_tensors`` takes one adapter's tensors of a state
dict. The learner's one AdamW holds every adapter, and a step of one adapter leaves every other
bit-identical: the step starts with every gradient set to None, only the active adapter gets one, and
AdamW skips a parameter without a gradient (no moment update, no weight decay).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from agentjet_client.errors import extra_hint
from agentjet_server.engine.adapter import ADAPTER, LoraSpec


def attach(model: torch.nn.Module, spec: LoraSpec, name: str = ADAPTER) -> Any:
    """Wrap ``model``'s target layers with LoRA modules (in place; the base weights are frozen)
    and return peft's wrapper; ``name`` is the adapter's (peft's ``default`` unless several are kept)."""
    try:
        from peft import get_peft_model
    except ImportError as exc:
        raise ImportError(extra_hint("--lora-rank", "lora", exc, package="agentjet-server")) from exc
    targets = spec.target_modules(model)
    head: Any = getattr(model, "get_output_embeddings", lambda: None)()
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    head_name = next((path for path, module in model.named_modules() if module is head), None)
    if tied and head_name is not None and head_name.rsplit(".", 1)[-1] in targets:
        raise ValueError(
            f"--lora-targets {spec.targets}: this model's output head shares its weights with the input "
            f"embeddings, so an adapter on {head_name} would change both; leave it out of --lora-targets"
        )
    config = lora_config(spec, model)
    try:
        return get_peft_model(model, config, adapter_name=name)
    except ValueError as exc:  # no module matched the targets
        raise ValueError(f"--lora-targets {spec.targets}: {exc}") from exc


def lora_config(spec: LoraSpec, model: torch.nn.Module) -> Any:
    """peft's configuration of an adapter of ``spec`` on ``model``."""
    from peft import LoraConfig

    return LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,  # type: ignore[arg-type]  # peft annotates int; it divides, floats work
        lora_dropout=spec.dropout,
        target_modules=spec.target_modules(model),
        bias="none",
    )


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def adapter_of(name: str) -> str | None:
    """The adapter a parameter name belongs to (``...q_proj.lora_A.planner.weight`` -> ``planner``), or None."""
    for marker in (".lora_A.", ".lora_B."):
        if marker in name:
            return name.split(marker, 1)[1].split(".", 1)[0]
    return None


def attach_adapters(model: torch.nn.Module, spec: LoraSpec, names: Sequence[str]) -> Any:
    """One LoRA adapter of ``spec`` per name on ``model`` (in place; the base frozen); peft's wrapper."""
    if not names or len(set(names)) != len(names):
        raise ValueError(f"adapters need distinct names, got {list(names)}")
    if ADAPTER in names:
        raise ValueError(f"'{ADAPTER}' names the one adapter of --lora-rank without --adapters: choose another name")
    config = lora_config(spec, model)  # resolved before wrapping: after it, the LoRA layers are linear too
    peft = attach(model, spec, names[0])
    for name in names[1:]:
        peft.add_adapter(name, config)
    activate(model, names[0])
    for param_name, param in model.named_parameters():  # every adapter is trainable: the optimizer holds all
        param.requires_grad_(adapter_of(param_name) is not None)
    return peft


def adapter_names(model: torch.nn.Module) -> list[str]:
    """The adapters on ``model``, in the order they were added."""
    seen: dict[str, None] = {}
    for name, _ in model.named_parameters():
        adapter = adapter_of(name)
        if adapter is not None:
            seen.setdefault(adapter, None)
    return list(seen)


def agent_adapters(model: torch.nn.Module) -> tuple[str, ...]:
    """The adapters per agent on ``model`` (none for a plain model, or the one adapter of plain LoRA)."""
    return tuple(name for name in adapter_names(model) if name != ADAPTER)


def activate(model: torch.nn.Module, name: str | None, names: Sequence[str] | None = None) -> None:
    """Make ``name`` the adapter every LoRA layer applies, and the only one whose parameters need gradients
    (``names``: the adapters a learner has, for its error message)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    if names is not None and name not in names:
        raise ValueError(f"a step names one of the learner's adapters ({', '.join(names) or 'none'}), not {name!r}")
    if name is None or name not in adapter_names(model):
        raise ValueError(f"no adapter '{name}' on this model (it has {', '.join(adapter_names(model))})")
    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            module.set_adapter(name)  # peft: the active adapter's parameters need gradients, the others' not
    for param_name, param in model.named_parameters():
        adapter = adapter_of(param_name)
        param.requires_grad_(adapter == name)


def adapter_tensors(state: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    """Adapter ``name``'s tensors of a state dict (peft's names, with the adapter's name in them)."""
    return {n: t for n, t in state.items() if adapter_of(n) == name}
