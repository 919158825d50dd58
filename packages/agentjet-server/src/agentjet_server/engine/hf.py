"""The transformers engine: continuously batched sampling with a KV cache on CPU or GPU.

One engine thread owns the model and loops: take in the requests that arrived (prefilled
together, left-padded), merge them into the running batch, run one decode step for every
running row, drop the rows that finished. So a newcomer's first token comes after one prefill,
not after the batch already decoding. The running batch's K/V share a right edge: each row's
tokens sit in its rightmost columns with padding masked out to the left, a newcomer's cache is
padded to the batch's width (or the batch to the newcomer's) and concatenated along the batch,
and columns no remaining row uses are trimmed when rows leave. New weights are copied in by the
same thread between two steps, so no forward pass ever sees half-updated weights, and each token
is tagged with the version of the weights its logits came from. Models whose cache layers are not
plain growing K/V (sliding windows, linear attention) decode in waves: newcomers wait for the
running batch to finish.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import queue
import threading
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from agentjet_server.engine.base import Engine, EngineOptions, SamplingParams, TokenEvent
from agentjet_server.engine.handoff import TokenStream, WeightSlot
from agentjet_server.errors import EngineError, ModelLoadError

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class _Request(TokenStream):
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    output_ids: list[int] = field(default_factory=list)


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
class _Batch:
    """The rows decoding together: K/V in ``cache`` with ``mask`` marking each row's columns,
    ``positions`` the position of each row's next token, ``tokens`` each row's last sample."""

    requests: list[_Request]
    cache: Any
    mask: torch.Tensor
    positions: torch.Tensor
    tokens: torch.Tensor


_WAKE = object()


class TransformersEngine(Engine):
    """Inference with ``transformers`` models: continuously batched, KV-cached, version-tagged."""

    def __init__(
        self, model_path: str | Path, options: EngineOptions | None = None, *, continuous: bool = True
    ) -> None:
        """``continuous=False`` decodes in waves (newcomers wait for the running batch to end),
        as models whose cache cannot be merged always do; kept for side-by-side benchmarks."""
        from transformers import AutoModelForCausalLM

        options = options or EngineOptions()
        super().__init__(
            model_path, model_name=options.model_name, chat_template=options.chat_template, version=options.version
        )
        try:
            model: Any = AutoModelForCausalLM.from_pretrained(str(self.model_path), dtype=options.dtype)
            self.model = model.to(options.device).eval()
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"could not load model weights from {self.model_path}: {exc}") from exc
        self.device = torch.device(options.device)
        self.max_batch = options.max_batch
        self.max_context = int(getattr(self.model.config, "max_position_embeddings", 4096))
        self.pad_id = self.chat.pad_id
        # transformers renamed ``past_key_values`` to ``cache``; speak whichever this version knows
        self._cache_kwarg = (
            "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        )

        self._requests: queue.Queue[_Request | object] = queue.Queue()
        self._weights = WeightSlot()
        self._closed = threading.Event()
        self.prefills = 0  # forward passes over newcomers' prompts
        self.forward_passes = 0
        self.largest_batch = 0
        self.continuous = continuous
        self._merges = continuous  # whether newcomers may join a running batch (see _prefill)
        self._roomy = _roomy_layer_class()
        self.tokens_sampled = 0
        self._thread = threading.Thread(target=self._run, name="agentjet-engine", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------------------- interface

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> AsyncIterator[TokenEvent]:
        if self._closed.is_set():
            raise EngineError("the engine is shut down")
        generator = torch.Generator()
        if params.seed is not None:
            generator.manual_seed(params.seed)
        else:
            generator.seed()
        request = _Request(
            loop=asyncio.get_running_loop(),
            events=asyncio.Queue(),
            prompt_ids=list(prompt_ids),
            params=params,
            generator=generator,
        )
        self._requests.put(request)
        async with aclosing(request.until_finished()) as events:  # one abandoned leaves at the next step
            async for event in events:
                yield event

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        self._weights.offer(state_dict, version, lambda: self._requests.put(_WAKE), self._closed)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """A copy of the weights being served (taken between updates only if no update is pending)."""
        return {k: v.detach().clone().cpu() for k, v in self.model.state_dict().items()}

    def close(self) -> None:
        self._closed.set()
        self._requests.put(_WAKE)
        self._thread.join(timeout=10)

    # ----------------------------------------------------------------------------- engine thread

    def _apply_pending_weights(self) -> None:
        update = self._weights.take()
        if update is None:
            return
        try:
            with torch.no_grad():
                self.model.load_state_dict(dict(update.state_dict), strict=True)
            self._version = update.version
        except Exception as exc:  # reported to the learner that asked for it
            update.error = exc
        finally:
            update.applied.set()

    def _take(self, room: int, wait: bool) -> list[_Request]:
        """Up to ``room`` waiting requests; blocks briefly for the first one only when ``wait``."""
        taken: list[_Request] = []
        while len(taken) < room:
            try:
                item = self._requests.get(timeout=0.5) if wait and not taken else self._requests.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _Request) and not item.cancelled:
                taken.append(item)
            elif wait and not taken:
                break  # woken for weights or shutdown
        return taken

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        running: _Batch | None = None
        while not self._closed.is_set():
            self._apply_pending_weights()
            newcomers: list[_Request] = []
            if running is None or self._merges:
                room = self.max_batch - (len(running.requests) if running else 0)
                newcomers = self._take(room, wait=running is None)
            try:
                if newcomers:
                    joined = self._prefill(newcomers)
                    running = self._merge(running, joined) if running is not None else joined
                if running is not None:
                    running = self._step(running)
            except Exception as exc:  # one bad batch must not kill serving
                logger.exception("engine batch failed")
                for request in (running.requests if running is not None else []) + newcomers:
                    request.push(EngineError(f"generation failed: {exc}"))
                running = None
        for request in (running.requests if running is not None else []) + self._drain():
            request.push(EngineError("the engine is shut down"))

    def _drain(self) -> list[_Request]:
        left: list[_Request] = []
        while True:
            try:
                item = self._requests.get_nowait()
            except queue.Empty:
                return left
            if isinstance(item, _Request):
                left.append(item)

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any) -> torch.Tensor:
        self.forward_passes += 1
        out = self.model(
            input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **{self._cache_kwarg: cache}
        )
        logits: torch.Tensor = out.logits[:, -1, :]
        return logits

    def _prefill(self, requests: list[_Request]) -> _Batch | None:
        """Newcomers' prompts in one left-padded pass; their first tokens are sampled from it."""
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        self.prefills += 1
        width = max(len(r.prompt_ids) for r in requests)
        ids = torch.full((len(requests), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(requests), width), dtype=torch.long)
        for i, request in enumerate(requests):
            n = len(request.prompt_ids)
            ids[i, width - n :] = torch.tensor(request.prompt_ids)
            mask[i, width - n :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        # only plain growing K/V can be padded and concatenated; anything else decodes in waves
        plain = all(type(layer) is DynamicLayer for layer in cache.layers)
        if plain:
            cache.layers = [self._roomy() for _ in cache.layers]
        self._merges = self.continuous and plain
        ids, mask, positions = ids.to(self.device), mask.to(self.device), positions.to(self.device)
        logits = self._forward(ids, mask, positions, cache)
        batch = _Batch(requests, cache, mask, positions[:, -1:] + 1, torch.zeros(0, dtype=torch.long))
        return self._sampled(batch, logits)

    def _step(self, batch: _Batch) -> _Batch | None:
        """One decode step for every running row."""
        batch.mask = torch.cat([batch.mask, batch.mask.new_ones((len(batch.requests), 1))], dim=1)
        logits = self._forward(batch.tokens.unsqueeze(1), batch.mask, batch.positions, batch.cache)
        batch.positions = batch.positions + 1
        return self._sampled(batch, logits)

    def _sampled(self, batch: _Batch, logits: torch.Tensor) -> _Batch | None:
        """Sample each row's next token from ``logits``; the rows that finished leave the batch."""
        self.largest_batch = max(self.largest_batch, len(batch.requests))
        live = [not r.cancelled for r in batch.requests]
        batch.tokens = self._sample(batch.requests, live, logits, self._version)
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

    @staticmethod
    def _merge(running: _Batch, joined: _Batch | None) -> _Batch:
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

    def _sample(self, batch: list[_Request], live: list[bool], logits: torch.Tensor, version: int) -> torch.Tensor:
        """Each live row's next token, pushed to its caller; a row that finished is marked dead."""
        logprobs = torch.log_softmax(logits.float(), dim=-1).cpu()
        scores = logits.float().cpu()
        chosen = torch.full((len(batch),), self.pad_id, dtype=torch.long)
        for i, request in enumerate(batch):
            if not live[i]:
                continue
            if request.cancelled:
                live[i] = False
                continue
            token = self._pick(scores[i], request.params, request.generator)
            chosen[i] = token
            request.output_ids.append(token)
            top: list[tuple[int, float]] = []
            if request.params.top_logprobs:
                values, indices = logprobs[i].topk(request.params.top_logprobs)
                top = [(int(t), float(v)) for t, v in zip(indices, values, strict=True)]
            finish = self._finish_reason(request, token)
            if finish is not None:
                live[i] = False
            self.tokens_sampled += 1
            request.push(TokenEvent(token, float(logprobs[i, token]), version, top, finish))
        return chosen.to(self.device)

    @staticmethod
    def _pick(scores: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
        if params.temperature <= 0.0:
            return int(scores.argmax())
        probs = torch.softmax(scores / params.temperature, dim=-1)
        if params.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            keep = sorted_probs.cumsum(-1) - sorted_probs < params.top_p
            keep[0] = True
            filtered = torch.zeros_like(probs)
            filtered[order[keep]] = sorted_probs[keep]
            probs = filtered / filtered.sum()
        return int(torch.multinomial(probs, 1, generator=generator))

    def _finish_reason(self, request: _Request, token: int) -> Any:
        if self.is_stop_token(token) or self.chat.hits_stop_string(request.output_ids, request.params.stop):
            return "stop"
        if len(request.output_ids) >= request.params.max_tokens:
            return "length"
        if len(request.prompt_ids) + len(request.output_ids) >= self.max_context:
            return "length"
        return None
