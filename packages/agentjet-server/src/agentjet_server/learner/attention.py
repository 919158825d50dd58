"""The learner's attention: transformers' SDPA, minus a fall-back to the quadratic kernel.

With grouped-query attention (fewer key/value heads than query heads: Qwen2 and most current
families) transformers asks PyTorch's SDPA for ``enable_gqa`` whenever no mask is given, which is how
the learner runs a tree chain by chain. On CUDA only the flash kernel takes ``enable_gqa``, and it
takes no fp32; so an fp32 learner there falls back to the math kernel, which keeps softmax(QK^T) for
the backward pass: heads x length^2 x 4 bytes per layer and chain, 10.5 GiB of a measured 48 GiB
step on a 0.5B-class model with 1,024-token chains (``bench/gpu.py``). Repeating the key/value
heads first lets the memory-efficient kernel take fp32 and keeps attention linear in length.
Elsewhere (bf16 or fp16 compute, CPU) the function is transformers' own.
"""

from __future__ import annotations

from typing import Any

import torch

NAME = "agentjet_sdpa"


class _OneGroup:
    """The attention module as SDPA's wrapper sees it once its key/value heads are repeated."""

    num_key_value_groups = 1

    def __init__(self, module: torch.nn.Module) -> None:
        self._module = module

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def learner_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    repeat_heads: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    """transformers' SDPA, with every query head given its own copy of its key/value head where only the
    math kernel would take them grouped (``repeat_heads`` None: fp32 on CUDA outside autocast) or always
    (``repeat_heads=True``)."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    if repeat_heads is None:  # under autocast the kernel gets bf16 or fp16 (flash takes grouped heads)
        repeat_heads = query.is_cuda and query.dtype == torch.float32 and not torch.is_autocast_enabled("cuda")
    groups = int(getattr(module, "num_key_value_groups", 1))
    if repeat_heads and groups > 1:
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
        return sdpa_attention_forward(_OneGroup(module), query, key, value, attention_mask, **kwargs)  # type: ignore[arg-type]
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def register(name: str, function: Any) -> None:
    """Make ``function`` an attention implementation transformers knows as ``name``, with SDPA's
    masks: a name without a mask function gets no mask at all (transformers' rule for outside
    kernels), and a chain continuing its ancestors' keys would attend to the wrong ones."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, sdpa_mask)


def use_learner_attention(model: torch.nn.Module) -> bool:
    """Switch a transformers model that attends with SDPA to ``learner_sdpa``; whether it did."""
    config = getattr(model, "config", None)
    switch: Any = getattr(model, "set_attn_implementation", None)
    if getattr(config, "_attn_implementation", None) != "sdpa" or switch is None:
        return False
    register(NAME, learner_sdpa)
    switch(NAME)
    return True
