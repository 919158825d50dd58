"""Several LoRA adapters on one frozen base, each trained alone: the learner's side of an adapter per
agent (issue 37: ``--adapters planner,executor``; not wired into the server yet).

``attach_adapters`` puts one adapter per name on the model (in place, as ``lora.attach`` does for one);
``Learner.step(batch, adapter=NAME)`` trains one. The learner's one AdamW holds every adapter (its state,
and so a checkpoint's, is by parameter name), and a step of one adapter leaves every other bit-identical:
``activate`` makes only that adapter's parameters need gradients, the step starts with every gradient
set to None, and AdamW skips a parameter without a gradient altogether (no moment update, no weight
decay). ``adapter_tensors`` and ``engine.adapter.write_adapter(..., name=)`` give each adapter in peft's
format.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from agentjet_server.engine.adapter import ADAPTER, LoraSpec
from agentjet_server.learner.lora import adapter_of, attach, lora_config


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
