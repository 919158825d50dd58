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

from typing import Any

import torch

from agentjet_server.engine.adapter import ADAPTER, LoraSpec


def attach(model: torch.nn.Module, spec: LoraSpec, name: str = ADAPTER) -> Any:
    """Wrap ``model``'s target layers with LoRA modules (in place; the base weights are frozen)
    and return peft's wrapper; ``name`` is the adapter's (peft's ``default`` unless several are kept)."""
    try:
        from peft import get_peft_model
    except ImportError as exc:
        raise ImportError("--lora-rank needs peft: pip install 'agentjet-server[lora]' (or pip install peft)") from exc
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


def base_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A LoRA-wrapped model's state dict without its adapters, under the plain model's names (the base)."""
    return {name.replace(".base_layer.", "."): tensor for name, tensor in state.items() if not is_adapter(name)}
