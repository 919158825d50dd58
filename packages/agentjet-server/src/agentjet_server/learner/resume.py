"""A learner's training state as a checkpoint keeps it, and back: model weights under the model's own
names (LoRA: the merged model, and the adapter apart), the critic's value head (PPO), the optimizer's
state by parameter name (so it loads into any world size), the step count and the RNG states.
Collective under FSDP: every rank calls, rank 0 holds (or passes) the whole state."""

from __future__ import annotations

import random
from typing import Any

import torch

from agentjet_server.engine.adapter import LoraSpec
from agentjet_server.engine.lora_layers import adapter_tensors, agent_adapters
from agentjet_server.learner.distributed import DistContext, full_state_dict
from agentjet_server.learner.lora import adapter_state, base_weights, merged
from agentjet_server.learner.policy import PolicyModel


def training_state(
    model: torch.nn.Module,
    policy: PolicyModel,
    optimizer: torch.optim.Optimizer,
    ctx: DistContext,
    lora: LoraSpec | None,
    steps: int,
) -> dict[str, Any]:
    """Everything a resumed learner needs, whole, on rank 0 (collective under FSDP; ``{}``
    elsewhere): model weights (HF names), the critic's value head, optimizer state (by
    parameter name, so it loads into any world size), step count and RNG state. With an adapter per
    agent, the weights are the base's and each adapter is kept apart (``adapters``)."""
    adapters = agent_adapters(model)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    optimizer_state = get_optimizer_state_dict(policy, optimizer, options=options)
    raw = full_state_dict(model, ctx)
    if lora is not None and raw:
        weights = base_weights(raw) if adapters else merged(raw, lora)
    else:
        weights = raw
    critic = full_state_dict(policy.value_head, ctx) if policy.value_head is not None else None
    if not ctx.is_main:
        return {}
    state: dict[str, Any] = {
        "weights": weights,
        "optimizer": optimizer_state,
        "steps": steps,
        "rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
    }
    if critic is not None:
        state["critic"] = critic
    if lora is not None and adapters:
        state["adapters"] = {name: adapter_tensors(raw, name) for name in adapters}
        state["lora"] = lora.as_dict()
    elif lora is not None:
        state["adapter"] = adapter_state(raw)
        state["lora"] = lora.as_dict()
    return state


def load_training_state(
    model: torch.nn.Module,
    policy: PolicyModel,
    optimizer: torch.optim.Optimizer,
    ctx: DistContext,
    lora: LoraSpec | None,
    state: dict[str, Any] | None,
) -> int:
    """Inverse of ``training_state``: rank 0 passes the state, the others ``None`` (collective).
    Loads it into ``policy`` and ``optimizer`` and returns the step count."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=ctx.enabled)
    adapters = agent_adapters(model)
    if state:
        check_lora(state.get("lora"), lora)
        check_adapters(state.get("adapters"), adapters)
    weights: dict[str, Any] = {}
    if state and lora is not None:
        # the base is the run's --model, as it was; only the adapters were trained
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=ctx.enabled, strict=False)
        kept = list(state["adapters"].values()) if adapters else [state["adapter"]]
        weights = {f"lm.{k}": v for tensors in kept for k, v in tensors.items()}
    elif state:
        weights = {f"lm.{k}": v for k, v in _complete_tied(model, state["weights"]).items()}
    if state and policy.value_head is not None:
        if "critic" not in state:
            raise ValueError(
                "the checkpoint has no critic (it was trained with --algorithm grpo); resume it with "
                "--algorithm grpo, or start PPO from its model dir with --model"
            )
        weights.update({f"value_head.{k}": v for k, v in state["critic"].items()})
    set_model_state_dict(policy, weights, options=options)
    set_optimizer_state_dict(policy, optimizer, state["optimizer"] if state else {}, options=options)
    steps = state["steps"] if state else 0
    if ctx.enabled:
        import torch.distributed as dist

        box = [steps]
        dist.broadcast_object_list(box, src=0)
        steps = box[0]
    if state:
        torch.set_rng_state(state["rng"])
        random.setstate(state["python_rng"])
    return int(steps)


def _complete_tied(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fill names that a saved HF checkpoint leaves out because they share a tensor with another
    (a tied output head); any other missing name is an error."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    out = dict(weights)
    missing = []
    for names in groups.values():
        present = [n for n in names if n in weights]
        for name in names:
            if name not in out:
                if present:
                    out[name] = weights[present[0]]
                else:
                    missing.append(name)
    if missing:
        raise ValueError(f"the checkpoint has no weights for {', '.join(sorted(missing)[:5])}")
    return out


def check_donor(model: torch.nn.Module, policy: PolicyModel, lora: LoraSpec | None, state: dict[str, Any]) -> None:
    """ValueError, saying why, when another run's training state cannot be loaded into this learner
    (checked before anything is loaded: a refused state leaves the learner as it was)."""
    check_lora(state.get("lora"), lora)
    if "adapters" in state or any(
        ".lora_A." in name and ".default." not in name for name, _ in model.named_parameters()
    ):
        raise ValueError("adopting another run's checkpoint is not supported with an adapter per agent")
    if policy.value_head is not None and "critic" not in state:
        raise ValueError("the checkpoint has no critic (it was trained with --algorithm grpo) and this run is PPO")
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=False)}
    given = state["adapter"] if lora is not None else state["weights"]
    if lora is None:
        unknown = sorted(set(given) - set(shapes))
        if unknown:
            raise ValueError(f"the checkpoint is of another model: this one has no weight {unknown[0]}")
    for name, tensor in given.items():
        if name in shapes and tuple(tensor.shape) != shapes[name]:
            raise ValueError(
                f"the checkpoint is of another model: {name} is {tuple(tensor.shape)} there and {shapes[name]} here"
            )


def check_lora(saved: dict[str, Any] | None, current: LoraSpec | None) -> None:
    """A checkpoint resumes only with the adapter settings it was trained with (or without LoRA)."""
    if saved is None and current is None:
        return
    if saved is None:
        raise ValueError(
            "the checkpoint was trained without LoRA (every weight); resume it without --lora-rank, or start "
            "LoRA on its model (--model <checkpoint>/model) in a new state dir"
        )
    if current is None:
        raise ValueError(
            f"the checkpoint trained a LoRA adapter (rank {saved['rank']}); resume it with the same "
            f"--lora-rank {saved['rank']} --lora-alpha {saved['alpha']} --lora-targets {saved['targets']}"
        )
    if LoraSpec(**saved) != current:
        raise ValueError(f"the checkpoint's adapter was trained with {saved}; resume with the same --lora-* settings")


def check_adapters(saved: dict[str, Any] | None, current: tuple[str, ...]) -> None:
    """A checkpoint with an adapter per agent resumes only with the same adapters, and one without only
    without them."""
    if not saved and not current:
        return
    if not saved:
        raise ValueError(f"the checkpoint has no adapter per agent; resume it without --adapters {','.join(current)}")
    if set(saved) != set(current):
        raise ValueError(
            f"the checkpoint holds the adapters {','.join(saved)}; resume it with --adapters {','.join(saved)}"
        )
