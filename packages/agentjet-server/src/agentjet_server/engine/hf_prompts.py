"""The transformers engine's prompt cache: the K/V and next-token logits of prompts it prefilled lately.

GRPO samples every prompt a group's worth of times, and a group's episodes start within moments of one
another: the first turn of each is the same prompt. A newcomer whose whole prompt is in the cache joins the
running batch without a forward pass, its first token sampled from the cached logits; newcomers that share
a prompt in one prefill are run once. Entries belong to the weights that computed them: the cache empties
when new weights land, so a cached token is exactly as on-policy as a fresh one. Bounded in entries and in
tokens (``PROMPT_CACHE_TOKENS`` per sequence of ``max_batch``), least recently used first out.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

import torch

PROMPT_CACHE_TOKENS = 512  # the prompt cache's tokens per concurrent sequence (a quarter of memory.KV_TOKENS)


@dataclass(frozen=True)
class Prefilled:
    """One prompt's K/V (per layer, ``(1, kv heads, len, head dim)``) and the logits of the token after it."""

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    logits: torch.Tensor  # (vocab,)

    @property
    def width(self) -> int:
        return int(self.keys[0].shape[2])


# a prompt as the cache knows it: the adapter it is run with (an adapter per agent; None: the one model) and
# its token ids
PromptKey = tuple[str | None, tuple[int, ...]]


class PromptCache:
    """Prompts (``PromptKey``) -> ``Prefilled``, for one version of the weights at a time (with an adapter
    per agent, one set of the adapters' versions: any adapter's update empties it)."""

    def __init__(self, max_entries: int, max_tokens: int) -> None:
        self.max_entries = max_entries
        self.max_tokens = max_tokens
        self.hits = 0
        self._version: Hashable = None
        self._entries: OrderedDict[PromptKey, Prefilled] = OrderedDict()
        self._tokens = 0

    def get(self, prompt: PromptKey, version: Hashable) -> Prefilled | None:
        if version != self._version:
            self._reset(version)
            return None
        found = self._entries.get(prompt)
        if found is not None:
            self._entries.move_to_end(prompt)
            self.hits += 1
        return found

    def put(self, prompt: PromptKey, version: Hashable, prefilled: Prefilled) -> None:
        if version != self._version:
            self._reset(version)
        if prefilled.width > self.max_tokens or prompt in self._entries:
            return
        self._entries[prompt] = prefilled
        self._tokens += prefilled.width
        while len(self._entries) > self.max_entries or self._tokens > self.max_tokens:
            _, dropped = self._entries.popitem(last=False)
            self._tokens -= dropped.width

    def __len__(self) -> int:
        return len(self._entries)

    def _reset(self, version: Hashable) -> None:
        self._version = version
        self._entries.clear()
        self._tokens = 0
