"""Several LoRA adapters on one frozen base, each trained alone: the learner's side of an adapter per
agent (issue 37: ``--adapters planner,executor``; not wired into the server yet).

``attach_adapters`` puts one adapter per name on the model (in place, as ``lora.attach`` does for one).
``AdapterOptimizers`` keeps one AdamW per adapter over that adapter's parameters only. A step of one
adapter (``activate`` it, forward and backward, ``step`` it) leaves every other adapter bit-identical: its
parameters need no gradient while another is active, no optimizer that steps holds them, and an adapter
is never stepped without gradients of its own (AdamW's momentum and weight decay would move it on zeros).
``adapter_tensors`` and ``engine.adapter.write_adapter(..., name=)`` give each adapter in peft's format.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from agentjet_server.engine.adapter import LoraSpec
from agentjet_server.learner.lora import adapter_of, attach, lora_config


def attach_adapters(model: torch.nn.Module, spec: LoraSpec, names: Sequence[str]) -> Any:
    """One LoRA adapter of ``spec`` per name on ``model`` (in place; the base frozen); peft's wrapper."""
    if not names or len(set(names)) != len(names):
        raise ValueError(f"adapters need distinct names, got {list(names)}")
    config = lora_config(spec, model)  # resolved before wrapping: after it, the LoRA layers are linear too
    peft = attach(model, spec, names[0])
    for name in names[1:]:
        peft.add_adapter(name, config)
    activate(model, names[0])
    return peft


def adapter_names(model: torch.nn.Module) -> list[str]:
    """The adapters on ``model``, in the order they were added."""
    seen: dict[str, None] = {}
    for name, _ in model.named_parameters():
        adapter = adapter_of(name)
        if adapter is not None:
            seen.setdefault(adapter, None)
    return list(seen)


def activate(model: torch.nn.Module, name: str) -> None:
    """Make ``name`` the adapter every LoRA layer applies, and the only one whose parameters need gradients."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    if name not in adapter_names(model):
        raise ValueError(f"no adapter '{name}' on this model (it has {', '.join(adapter_names(model))})")
    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            module.set_adapter(name)  # peft: the active adapter's parameters need gradients, the others' not
    for param_name, param in model.named_parameters():
        adapter = adapter_of(param_name)
        param.requires_grad_(adapter == name)


def adapter_parameters(model: torch.nn.Module, name: str) -> list[torch.nn.Parameter]:
    return [p for n, p in model.named_parameters() if adapter_of(n) == name]


def adapter_tensors(state: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    """Adapter ``name``'s tensors of a state dict (peft's names, with the adapter's name in them)."""
    return {n: t for n, t in state.items() if adapter_of(n) == name}


class AdapterOptimizers:
    """One AdamW per adapter, over that adapter's parameters only (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, names: Sequence[str], lr: float, weight_decay: float) -> None:
        self.optimizers = {
            name: torch.optim.AdamW(adapter_parameters(model, name), lr=lr, weight_decay=weight_decay) for name in names
        }
        self.steps = dict.fromkeys(names, 0)

    def zero_grad(self) -> None:
        for optimizer in self.optimizers.values():
            optimizer.zero_grad(set_to_none=True)

    def step(self, name: str) -> None:
        """Step adapter ``name``'s optimizer; refused when none of its parameters has a gradient."""
        optimizer = self.optimizers[name]
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if all(p.grad is None for p in params):
            raise ValueError(f"adapter '{name}' has no gradient: a step would move it on zeros")
        optimizer.step()
        self.steps[name] += 1

    def reconfigure(self, lr: float, weight_decay: float) -> None:
        for optimizer in self.optimizers.values():
            for group in optimizer.param_groups:
                group["lr"], group["weight_decay"] = lr, weight_decay
