"""The Hugging Face causal LM as the learner runs it: log-probs at trained tokens, the critic's values there
when PPO trains one, in the learner's compute precision, with the learner's attention.

``PolicyModel`` wraps the model so that the output head runs only where a token is trained (see
its docstring) and, for ``--algorithm ppo``, holds the value head: one linear layer on the
policy's last hidden state, detached, so the critic's loss trains the head and never moves the
policy's own weights (on the demo, letting it train the shared trunk slowed learning: the reward
reached 0.5 after 20,718 episodes instead of 9,669). Its forward passes run under ``autocast()``: the
precision the learner computes in (``--learner-dtype``), the weights keeping the dtype they were loaded in.

The learner's attention (``learner_sdpa``) is transformers' SDPA, minus a fall-back to the quadratic
kernel. With grouped-query attention (fewer key/value heads than query heads: Qwen2 and most current
families) transformers asks PyTorch's SDPA for ``enable_gqa`` whenever no mask is given, which is how
the learner runs a tree chain by chain. On CUDA only the flash kernel takes ``enable_gqa``, and it
takes no fp32; so an fp32 learner there falls back to the math kernel, which keeps softmax(QK^T) for
the backward pass: heads x length^2 x 4 bytes per layer and chain, 10.5 GiB of a measured 48 GiB
step on a 0.5B-class model with 1,024-token chains (``bench/gpu.py``). Repeating the key/value
heads first lets the memory-efficient kernel take fp32 and keeps attention linear in length.
Elsewhere (bf16 or fp16 compute, CPU) the function is transformers' own.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from agentjet_server.learner.packing import MicroBatch

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


def _cache_kwarg(module: Any) -> str:
    """transformers renamed ``past_key_values`` to ``cache``; speak whichever this version knows."""
    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


def chosen_and_entropy(logp: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """From log-probabilities ``[E, V]``: each entry's target's ``[E]``, and the entropy there ``[E]``."""
    chosen = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return chosen, -(logp.exp() * logp).sum(-1)


class PolicyModel(torch.nn.Module):
    """Wraps a causal LM: logits ``[E, V]`` at the E nodes whose next token is trained (and, with
    a value head, the critic's values ``[E]`` there).

    Runs on a packed micro-batch (one row, ``position_ids`` and an optional tree mask, see
    ``learner.packing``). The output head runs only at trained entries: prompts, tool results and
    shared prefixes make up most of a batch and need no logits, so the head (vocab x hidden, the
    largest matrix of a small model) costs in proportion to sampled tokens, not to context. Being
    one module with one ``forward`` also makes it the FSDP root, so a sharded model's embeddings,
    final norm and head are gathered around exactly this computation.
    """

    def __init__(self, model: torch.nn.Module, value_head: bool = False, bf16: bool = False) -> None:
        super().__init__()
        self.lm = model
        self.compute_bf16 = bf16  # compute under bf16 autocast (``autocast``)
        self.device_type = next(model.parameters()).device.type  # where autocast applies (set for offload)
        self.value_head: torch.nn.Linear | None = None
        if value_head:
            config: Any = model.config
            hidden = int(config.hidden_size)
            self.value_head = torch.nn.Linear(hidden, 1, device=next(model.parameters()).device)
            torch.nn.init.zeros_(self.value_head.weight)  # the critic starts at V = 0 everywhere
            torch.nn.init.zeros_(self.value_head.bias)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        nodes: torch.Tensor,
        segments: list[tuple[int, int, int]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        model: Any = self.lm
        decoder: Any = getattr(model, "get_decoder", lambda: None)()
        head: Any = getattr(model, "get_output_embeddings", lambda: None)()
        if segments is not None and (decoder is None or head is None):
            raise ValueError("segment-wise tree attention needs a Hugging Face causal LM (get_decoder)")
        inputs = {"input_ids": input_ids, "position_ids": position_ids, "attention_mask": attention_mask}
        if decoder is None or head is None:  # not a standard HF causal LM: full logits
            if self.value_head is not None:
                raise ValueError("a value head needs a Hugging Face causal LM (get_decoder)")
            return model(**inputs).logits[0, nodes], None
        if segments is not None:
            hidden = self._segment_hidden(decoder, input_ids, position_ids, segments)[nodes]
        else:
            hidden = decoder(**inputs).last_hidden_state[0, nodes]
        values = self.value_head(hidden.detach().float()).squeeze(-1) if self.value_head is not None else None
        return head(hidden), values

    def autocast(self) -> Any:
        """The learner's compute precision around a forward pass (backward follows it)."""
        return torch.autocast(self.device_type, dtype=torch.bfloat16, enabled=self.compute_bf16)

    def run(self, batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Log-prob of each trained entry's token, the policy's entropy there, and the values ``[E]``."""
        logp, values = self.distribution(batch)
        chosen, entropy = chosen_and_entropy(logp, batch.targets)
        return chosen, entropy, values

    def distribution(self, batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The log-probabilities of the whole vocabulary ``[E, V]`` (float32) at each trained entry, and the
        values ``[E]``, computed in the learner's precision."""
        with self.autocast():
            logits, values = self(
                batch.input_ids, batch.position_ids, batch.attention_mask, batch.entry_nodes, batch.segments
            )
            return torch.log_softmax(logits.float(), dim=-1), values

    def _segment_hidden(
        self, decoder: Any, input_ids: torch.Tensor, position_ids: torch.Tensor, segments: list[tuple[int, int, int]]
    ) -> torch.Tensor:
        """Hidden states ``[N, H]`` of a tree run chain by chain, each continuing from its
        ancestors' keys and values (kept in the graph: the prefix gets every branch's gradient)."""
        from transformers import DynamicCache

        config = getattr(self.lm, "config", None)
        cache_kwarg = _cache_kwarg(decoder)
        kv: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        hidden = []
        for start, end, parent in segments:
            chain = []
            while parent >= 0:
                chain.append(parent)
                parent = segments[parent][2]
            cache: Any = DynamicCache(config=config)
            if chain:
                chain.reverse()
                for layer in range(len(kv[chain[0]])):
                    keys = torch.cat([kv[s][layer][0] for s in chain], dim=2)
                    values = torch.cat([kv[s][layer][1] for s in chain], dim=2)
                    cache.update(keys, values, layer)
            out = decoder(
                input_ids=input_ids[:, start:end],
                position_ids=position_ids[:, start:end],
                use_cache=True,
                **{cache_kwarg: cache},
            )
            n = end - start
            kv.append([(layer.keys[:, :, -n:], layer.values[:, :, -n:]) for layer in cache.layers])
            hidden.append(out.last_hidden_state[0])
        return torch.cat(hidden)


def frozen(model: torch.nn.Module | None, like: PolicyModel) -> PolicyModel | None:
    """A model the learner only reads (the KL's reference, the distillation teacher), run as ``like`` runs."""
    if model is None:
        return None
    use_learner_attention(model)
    model.requires_grad_(False)
    model.eval()
    policy = PolicyModel(model, bf16=like.compute_bf16)
    policy.device_type = like.device_type
    return policy
