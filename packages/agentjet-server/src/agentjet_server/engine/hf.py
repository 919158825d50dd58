"""The transformers engine: batched sampling with a KV cache on CPU or GPU.

One engine thread owns the model. Requests queue up while a batch decodes; when the batch
ends, everything waiting is prefilled together (left-padded) and decoded in lock-step, one
forward pass per token for the whole batch. New weights are copied in by the same thread
between two decode steps, so no forward pass ever sees half-updated weights, and each token
is tagged with the version of the weights its logits came from.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import queue
import threading
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from agentjet_server.engine.base import SamplingParams, TokenEvent
from agentjet_server.engine.handoff import TokenStream, WeightSlot
from agentjet_server.engine.tokens import ChatTokenizer, TemplateEngine, check_model_dir
from agentjet_server.errors import EngineError, ModelLoadError

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class _Request(TokenStream):
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    output_ids: list[int] = field(default_factory=list)


_WAKE = object()


class TransformersEngine(TemplateEngine):
    """Inference with ``transformers`` models: batched, KV-cached, version-tagged."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        model_name: str | None = None,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        max_batch: int = 64,
        version: int = 0,
        chat_template: str | None = None,
    ) -> None:
        from transformers import AutoModelForCausalLM

        path = Path(model_path)
        check_model_dir(path)
        self.model_path = path
        self.model_name = model_name or path.name
        self.chat = ChatTokenizer(path, chat_template)
        try:
            model: Any = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
            self.model = model.to(device).eval()
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"could not load model weights from {path}: {exc}") from exc
        self.device = torch.device(device)
        self.max_batch = max_batch
        self.max_context = int(getattr(self.model.config, "max_position_embeddings", 4096))
        self.pad_id = self.chat.pad_id
        # transformers renamed ``past_key_values`` to ``cache``; speak whichever this version knows
        self._cache_kwarg = (
            "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        )

        self._version = version
        self._requests: queue.Queue[_Request | object] = queue.Queue()
        self._weights = WeightSlot()
        self._closed = threading.Event()
        self.batches_run = 0
        self.largest_batch = 0
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
        try:
            async for event in request.until_finished():
                yield event
        finally:
            request.cancelled = True

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

    def _take_batch(self) -> list[_Request]:
        batch: list[_Request] = []
        try:
            item = self._requests.get(timeout=0.5)
        except queue.Empty:
            return batch
        while True:
            if isinstance(item, _Request) and not item.cancelled:
                batch.append(item)
            if len(batch) >= self.max_batch:
                break
            try:
                item = self._requests.get_nowait()
            except queue.Empty:
                break
        return batch

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while not self._closed.is_set():
            self._apply_pending_weights()
            batch = self._take_batch()
            if not batch:
                continue
            try:
                self._decode_batch(batch)
            except Exception as exc:  # one bad batch must not kill serving
                logger.exception("engine batch failed")
                for request in batch:
                    request.push(EngineError(f"generation failed: {exc}"))
        for request in self._drain():
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

    def _decode_batch(self, batch: list[_Request]) -> None:
        from transformers import DynamicCache

        self.batches_run += 1
        self.largest_batch = max(self.largest_batch, len(batch))
        width = max(len(r.prompt_ids) for r in batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, request in enumerate(batch):
            n = len(request.prompt_ids)
            ids[i, width - n :] = torch.tensor(request.prompt_ids)
            mask[i, width - n :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        ids, mask, positions = ids.to(self.device), mask.to(self.device), positions.to(self.device)
        logits = self.model(
            input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **{self._cache_kwarg: cache}
        ).logits[:, -1, :]
        logits_version = self._version
        live = [not r.cancelled for r in batch]
        next_pos = positions[:, -1:] + 1
        while True:
            tokens = self._sample(batch, live, logits, logits_version)
            if not any(live):
                return
            self._apply_pending_weights()  # between decode steps: never inside a forward pass
            mask = torch.cat([mask, torch.ones((len(batch), 1), dtype=torch.long, device=self.device)], dim=1)
            logits = self.model(
                input_ids=tokens.unsqueeze(1),
                attention_mask=mask,
                position_ids=next_pos,
                use_cache=True,
                **{self._cache_kwarg: cache},
            ).logits[:, -1, :]
            logits_version = self._version
            next_pos = next_pos + 1

    def _sample(self, batch: list[_Request], live: list[bool], logits: torch.Tensor, version: int) -> torch.Tensor:
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
