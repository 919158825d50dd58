"""The transformers engine's running batch: newcomers prefilled, every row decoded one step, rows merged and dropped.

The running batch's K/V share a right edge: each row's tokens sit in its rightmost columns with
padding masked out to the left. Newcomers' prompts are prefilled together, left-padded; their cache
is padded to the batch's width (or the batch to theirs) and concatenated along the batch, and the
columns no remaining row uses are trimmed when rows leave. Models whose cache layers are not plain
growing K/V (sliding windows, linear attention) cannot be merged so: their newcomers wait for the
running batch to finish (``BatchRunner.merges``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from agentjet_server.engine.hf_prompts import Prefilled, PromptCache, PromptKey
from agentjet_server.engine.hf_sampling import Request, Sampler, Versions


def _roomy_layer_class() -> type:
    """``transformers``' growing K/V layer, with spare room at the end of its buffers: a decode step
    writes its token's K/V in place, where the stock layer copies the whole cache to append it."""
    from transformers.cache_utils import DynamicLayer

    class RoomyLayer(DynamicLayer):  # type: ignore[no-untyped-call]
        _keys: torch.Tensor  # (batch, kv heads, room, head dim); ``keys`` is the used part
        _values: torch.Tensor
        width = 0

        def hold(self, keys: torch.Tensor, values: torch.Tensor, extra: int = 0) -> None:
            """Keep ``keys`` and ``values`` (batch, heads, width, dim) with room for more columns."""
            batch, heads, width, dim = keys.shape
            room = width + extra + max(64, width // 2)
            self._keys = keys.new_empty((batch, heads, room, dim))
            self._values = values.new_empty((batch, values.shape[1], room, values.shape[3]))
            self._keys[:, :, :width] = keys
            self._values[:, :, :width] = values
            self._expose(width)
            self.dtype, self.device = keys.dtype, keys.device
            self.is_initialized = True

        def _expose(self, width: int) -> tuple[torch.Tensor, torch.Tensor]:
            self.width = width
            self.keys, self.values = self._keys[:, :, :width], self._values[:, :, :width]
            return self._keys[:, :, :width], self._values[:, :, :width]

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            if not self.is_initialized:
                self.hold(key_states, value_states)
                return self._expose(self.width)
            width, n = self.width, key_states.shape[2]
            if width + n > self._keys.shape[2]:
                self.hold(self._keys[:, :, :width], self._values[:, :, :width], extra=n)
            self._keys[:, :, width : width + n] = key_states
            self._values[:, :, width : width + n] = value_states
            return self._expose(width + n)

    return RoomyLayer


@dataclass
class Batch:
    """The rows decoding together: K/V in ``cache`` with ``mask`` marking each row's columns,
    ``positions`` the position of each row's next token, ``tokens`` each row's last sample."""

    requests: list[Request]
    cache: Any
    mask: torch.Tensor
    positions: torch.Tensor
    tokens: torch.Tensor


class BatchRunner:
    """Runs the model over the batch: a prefill for newcomers, a decode step for every running row, and
    ``sampler`` for each row's next token. Used by the engine thread alone."""

    def __init__(
        self,
        model: Any,
        device: torch.device,
        sampler: Sampler,
        continuous: bool,
        prompt_cache: tuple[int, int],
        adapters: bool = False,
    ) -> None:
        """``continuous=False`` decodes in waves (newcomers wait for the running batch to end);
        ``prompt_cache``: the most prompts and tokens the prompt cache keeps; ``adapters``: ``model`` is
        peft's wrapper with an adapter per agent, and each row is run with its request's adapter (peft's
        mixed-adapter batches: ``adapter_names``, one per row)."""
        self.model = model
        self.adapters = adapters
        self.device = device
        self.sampler = sampler
        self.continuous = continuous
        self.merges = continuous  # whether newcomers may join a running batch (see ``prefill``)
        self.prefills = 0  # forward passes over newcomers' prompts (the prompt cache's hits need none)
        self.prompts_run = 0  # prompts those passes ran (a prompt that several newcomers share: once)
        self.forward_passes = 0
        self.largest_batch = 0
        self._roomy = _roomy_layer_class()
        # transformers renamed ``past_key_values`` to ``cache``; speak whichever this version knows
        base = model.get_base_model() if adapters else model  # peft's wrapper passes its arguments through
        parameters = inspect.signature(base.forward).parameters
        self._cache_kwarg = "cache" if "cache" in parameters else "past_key_values"
        # logits for the last position only (a prompt's others are never sampled from)
        self._last_logits_only = {"logits_to_keep": 1} if "logits_to_keep" in parameters else {}
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        # only plain growing K/V can be padded, concatenated and cached; anything else decodes in waves
        self._new_cache: Callable[[], Any] = lambda: DynamicCache(config=base.config)
        self._plain = all(type(layer) is DynamicLayer for layer in self._new_cache().layers)
        self.prompts = PromptCache(max_entries=prompt_cache[0], max_tokens=prompt_cache[1])
        self._none = torch.zeros(0, dtype=torch.long)

    def prefill(self, requests: list[Request], version: Versions) -> Batch | None:
        """Newcomers' first tokens: each distinct prompt not in the prompt cache is run once, together in one
        left-padded pass; the rest come from the cache."""
        self.merges = self.continuous and self._plain
        if not self._plain:
            cache = self._new_cache()
            ids, mask, positions = self._left_padded([r.prompt_ids for r in requests])
            logits = self._forward(ids, mask, positions, cache, prompt=True, adapters=self._adapters(requests))
            return self._sampled(Batch(requests, cache, mask, positions[:, -1:] + 1, self._none), logits, version)
        rows: list[Prefilled | None] = [None] * len(requests)
        missing: dict[PromptKey, list[int]] = {}
        weights: Hashable = version if isinstance(version, int) else tuple(sorted(version.items()))
        for i, request in enumerate(requests):
            prompt = (request.params.adapter, tuple(request.prompt_ids))
            rows[i] = self.prompts.get(prompt, weights)
            if rows[i] is None:
                missing.setdefault(prompt, []).append(i)
        if missing:
            for prompt, prefilled in zip(missing, self._run_prompts(list(missing)), strict=True):
                self.prompts.put(prompt, weights, prefilled)
                for i in missing[prompt]:
                    rows[i] = prefilled
        ready = [row for row in rows if row is not None]
        width = max(row.width for row in ready)
        mask = torch.zeros((len(ready), width), dtype=torch.long, device=self.device)
        for i, row in enumerate(ready):
            mask[i, width - row.width :] = 1
        cache = self._new_cache()
        cache.layers = [self._roomy() for _ in cache.layers]
        for n, layer in enumerate(cache.layers):
            layer.hold(
                torch.cat([F.pad(row.keys[n], (0, 0, width - row.width, 0)) for row in ready]),
                torch.cat([F.pad(row.values[n], (0, 0, width - row.width, 0)) for row in ready]),
            )
        positions = torch.tensor([[row.width] for row in ready], device=self.device)
        logits = torch.stack([row.logits for row in ready])
        return self._sampled(Batch(requests, cache, mask, positions, self._none), logits, version)

    def _run_prompts(self, keys: list[PromptKey]) -> list[Prefilled]:
        """One left-padded forward pass over ``keys``' prompts (each with its adapter): each one's K/V and
        next-token logits."""
        prompts = [prompt for _, prompt in keys]
        ids, mask, positions = self._left_padded(prompts)
        cache = self._new_cache()
        adapters = [adapter or "" for adapter, _ in keys] if self.adapters else None
        logits = self._forward(ids, mask, positions, cache, prompt=True, adapters=adapters)
        self.prompts_run += len(prompts)
        width = ids.shape[1]
        return [
            Prefilled(
                keys=tuple(layer.keys[i : i + 1, :, width - len(p) :].clone() for layer in cache.layers),
                values=tuple(layer.values[i : i + 1, :, width - len(p) :].clone() for layer in cache.layers),
                logits=logits[i].clone(),  # not a view that keeps the whole pass's logits
            )
            for i, p in enumerate(prompts)
        ]

    def _left_padded(self, prompts: list[list[int]] | list[tuple[int, ...]]) -> tuple[torch.Tensor, ...]:
        """``prompts`` as one batch: token ids, attention mask and positions, padded on the left."""
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.sampler.chat.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, prompt in enumerate(prompts):
            ids[i, width - len(prompt) :] = torch.tensor(prompt)
            mask[i, width - len(prompt) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        return ids.to(self.device), mask.to(self.device), positions.to(self.device)

    def step(self, batch: Batch, version: Versions) -> Batch | None:
        """One decode step for every running row."""
        batch.mask = torch.cat([batch.mask, batch.mask.new_ones((len(batch.requests), 1))], dim=1)
        adapters = self._adapters(batch.requests)
        logits = self._forward(batch.tokens.unsqueeze(1), batch.mask, batch.positions, batch.cache, adapters=adapters)
        batch.positions = batch.positions + 1
        return self._sampled(batch, logits, version)

    @staticmethod
    def merge(running: Batch, joined: Batch | None) -> Batch:
        """``joined``'s rows appended to ``running``: the narrower one is padded on the left."""
        if joined is None:
            return running
        width = max(running.mask.shape[1], joined.mask.shape[1])

        def left(t: torch.Tensor, dim: int) -> torch.Tensor:
            missing = width - t.shape[dim]
            if not missing:
                return t
            return F.pad(t, (0, 0, missing, 0) if dim == 2 else (missing, 0))

        running.mask = torch.cat([left(running.mask, 1), left(joined.mask, 1)])
        for mine, theirs in zip(running.cache.layers, joined.cache.layers, strict=True):
            mine.hold(
                torch.cat([left(mine.keys, 2), left(theirs.keys, 2)]),
                torch.cat([left(mine.values, 2), left(theirs.values, 2)]),
            )
        running.positions = torch.cat([running.positions, joined.positions])
        running.tokens = torch.cat([running.tokens, joined.tokens])
        running.requests = running.requests + joined.requests
        return running

    def _adapters(self, requests: list[Request]) -> list[str] | None:
        """Each row's adapter (an adapter per agent), else None."""
        return [r.params.adapter or "" for r in requests] if self.adapters else None

    def _forward(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        cache: Any,
        prompt: bool = False,
        adapters: list[str] | None = None,
    ) -> torch.Tensor:
        self.forward_passes += 1
        self.prefills += prompt
        by_row = {} if adapters is None else {"adapter_names": adapters}
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **{self._cache_kwarg: cache},
            **self._last_logits_only,
            **by_row,
        )
        logits: torch.Tensor = out.logits[:, -1, :]
        return logits

    def _sampled(self, batch: Batch, logits: torch.Tensor, version: Versions) -> Batch | None:
        """Sample each row's next token from ``logits``; the rows that finished leave the batch."""
        self.largest_batch = max(self.largest_batch, len(batch.requests))
        live = [not r.cancelled for r in batch.requests]
        batch.tokens = self.sampler.sample(batch.requests, live, logits, version).to(self.device)
        if all(live):
            return batch
        keep = [i for i, alive in enumerate(live) if alive]
        if not keep:
            return None
        rows = torch.tensor(keep, device=self.device)
        batch.requests = [batch.requests[i] for i in keep]
        batch.mask, batch.positions, batch.tokens = batch.mask[rows], batch.positions[rows], batch.tokens[rows]
        # columns that only the rows that left used are dropped
        first = int(batch.mask.any(0).to(torch.int8).argmax())
        batch.mask = batch.mask[:, first:]
        for layer in batch.cache.layers:
            layer.hold(layer.keys[rows, :, first:], layer.values[rows, :, first:])
        return batch
