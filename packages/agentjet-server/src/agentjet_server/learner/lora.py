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

import torch

from agentjet_server.engine.adapter import ADAPTER, LoraSpec
from agentjet_server.engine.lora_layers import is_adapter


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
