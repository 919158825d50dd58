"""The transformers engine: continuously batched sampling with a KV cache on CPU or GPU.

One engine thread owns the model and loops: take in the requests that arrived (prefilled
together, left-padded; a prompt prefilled lately under the same weights comes from the prompt
cache, ``hf_prompts``), merge them into the running batch, run one decode step for every
running row, drop the rows that finished (``hf_batch.BatchRunner``; each row's next token is
picked by ``hf_sampling.Sampler``). So a newcomer's first token comes after one prefill, not after
the batch already decoding. New weights are copied in by the same thread between two steps, so no
forward pass ever sees half-updated weights, and each token is tagged with the version of the
weights its logits came from.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import aclosing
from pathlib import Path
from typing import Any

import torch

from agentjet_server.engine.base import (
    PROCESSED_SETTINGS,
    Engine,
    EngineOptions,
    SamplingParams,
    TokenEvent,
    check_adapter,
    named_version,
)
from agentjet_server.engine.grammar import Grammars
from agentjet_server.engine.handoff import WeightSlot
from agentjet_server.engine.hf_batch import Batch, BatchRunner
from agentjet_server.engine.hf_prompts import PROMPT_CACHE_TOKENS
from agentjet_server.engine.hf_sampling import Request, Sampler
from agentjet_server.errors import EngineError, ModelLoadError

logger = logging.getLogger(__name__)

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
        # an adapter per agent: peft's adapters on the frozen base (``self.model`` keeps the plain model's
        # interface and names; ``forward`` is peft's wrapper, which runs each row with its own adapter)
        forward: Any = self.model
        if options.adapters:
            if options.lora is None:
                raise ValueError("an adapter per agent needs the adapters' LoRA settings (--lora-rank)")
            from agentjet_server.engine.lora_layers import attach_adapters

            forward = attach_adapters(self.model, options.lora, options.adapters).eval()
            forward.requires_grad_(False)
            counts = dict(options.adapter_versions)
            self._named = {name: counts.get(name, 0) for name in options.adapters}
        self.device = torch.device(options.device)
        self.max_batch = options.max_batch
        self.max_context = int(getattr(self.model.config, "max_position_embeddings", 4096))
        self.continuous = continuous
        # the running batch, and its counters (prefills, prompts_run, forward_passes; prompts.hits)
        self.batches = BatchRunner(
            forward,
            self.device,
            Sampler(self.chat, self.max_context),
            continuous,
            prompt_cache=(self.max_batch, self.max_batch * PROMPT_CACHE_TOKENS),
            adapters=bool(self._named),
        )
        self._grammars = Grammars(self.chat, int(self.model.config.vocab_size))
        self._requests: queue.Queue[Request | object] = queue.Queue()
        self._weights = WeightSlot()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="agentjet-engine", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------------------- interface

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> AsyncIterator[TokenEvent]:
        if self._closed.is_set():
            raise EngineError("the engine is shut down")
        check_adapter(params.adapter, self._named)
        generator = torch.Generator()
        if params.seed is not None:
            generator.manual_seed(params.seed)
        else:
            generator.seed()
        request = Request(
            loop=asyncio.get_running_loop(),
            events=asyncio.Queue(),
            prompt_ids=list(prompt_ids),
            params=params,
            generator=generator,
            grammar=self._grammars.matcher(params.grammar) if params.grammar else None,
        )
        self._requests.put(request)
        async with aclosing(request.until_finished()) as events:  # a request abandoned is dropped at the next step
            async for event in events:
                yield event

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        if self._named:
            raise EngineError("this engine serves an adapter per agent: update them with update_named_adapter")
        self._weights.offer(state_dict, version, lambda: self._requests.put(_WAKE), self._closed)

    def update_named_adapter(self, name: str, adapter: Mapping[str, torch.Tensor], version: int) -> None:
        named_version(name, self._named)
        from agentjet_server.engine.lora_layers import adapter_of

        own = {key for key, _ in self.model.named_parameters() if adapter_of(key) == name}
        wrong, missing = sorted(set(adapter) - own), sorted(own - set(adapter))
        if wrong or missing:
            raise ValueError(
                f"adapter {name!r}: tensors that are not its {wrong[:3]}, or of its own missing {missing[:3]}"
            )
        wake = lambda: self._requests.put(_WAKE)  # noqa: E731
        self._weights.offer(adapter, version, wake, self._closed, adapter=name)

    @property
    def processed_settings(self) -> frozenset[str]:
        return PROCESSED_SETTINGS

    def state_dict(self) -> dict[str, torch.Tensor]:
        """A copy of the weights being served (taken between updates only if no update is pending)."""
        return {k: v.detach().clone().cpu() for k, v in self.model.state_dict().items()}

    def close(self) -> None:
        self._closed.set()
        self._requests.put(_WAKE)
        self._thread.join(timeout=10)

    @property
    def largest_batch(self) -> int:
        """The most rows one forward pass has sampled for."""
        return self.batches.largest_batch

    @property
    def tokens_sampled(self) -> int:
        """Tokens sampled so far, over every request."""
        return self.batches.sampler.tokens_sampled

    # ----------------------------------------------------------------------------- engine thread

    def _apply_pending_weights(self) -> None:
        update = self._weights.take()
        if update is None:
            return
        try:
            with torch.no_grad():
                if update.adapter is None:
                    self.model.load_state_dict(dict(update.state_dict), strict=True)
                    self._version = update.version
                else:  # one adapter's tensors, under the names the learner's model gives them
                    self._load_adapter(update.state_dict)
                    self._named[update.adapter] = update.version
        except Exception as exc:  # reported to the learner that asked for it
            update.error = exc
        finally:
            update.applied.set()

    def _load_adapter(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """One adapter's tensors (checked by ``update_named_adapter``) into its parameters, in place."""
        params = dict(self.model.named_parameters())
        for key, tensor in tensors.items():
            params[key].copy_(tensor)

    def _score(self, request: Request) -> list[float]:
        """The log-probability of each of ``request``'s prompt tokens after the first (its adapter's, if any),
        one position at a time from the logits of a forward pass over the whole prompt."""
        ids = torch.tensor([request.prompt_ids], device=self.device)
        by_row = {"adapter_names": [request.params.adapter or ""]} if self._named else {}
        logits = self.batches.model(input_ids=ids, **by_row).logits[0, :-1].float()
        logprobs = torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None])[:, 0]
        return [float(x) for x in logprobs.cpu()]

    def _versions(self) -> int | dict[str, int]:
        """The versions rows are sampled from now: the model's, or with adapters each adapter's."""
        return dict(self._named) if self._named else self._version

    def _take(self, room: int, wait: bool) -> list[Request]:
        """Up to ``room`` waiting requests; blocks briefly for the first one only when ``wait``."""
        taken: list[Request] = []
        while len(taken) < room:
            try:
                item = self._requests.get(timeout=0.5) if wait and not taken else self._requests.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Request) and not item.cancelled:
                taken.append(item)
            elif wait and not taken:
                break  # woken for weights or shutdown
        return taken

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        batches = self.batches
        running: Batch | None = None
        while not self._closed.is_set():
            self._apply_pending_weights()
            newcomers: list[Request] = []
            if running is None or batches.merges:
                room = self.max_batch - (len(running.requests) if running else 0)
                newcomers = self._take(room, wait=running is None)
            try:
                for request in newcomers:
                    if request.params.prompt_logprobs:
                        request.prompt_logprobs = self._score(request)
                if newcomers:
                    joined = batches.prefill(newcomers, self._versions())
                    running = batches.merge(running, joined) if running is not None else joined
                if running is not None:
                    running = batches.step(running, self._versions())
            except Exception as exc:  # one bad batch must not kill serving
                logger.exception("engine batch failed")
                for request in (running.requests if running is not None else []) + newcomers:
                    request.push(EngineError(f"generation failed: {exc}"))
                running = None
        for request in (running.requests if running is not None else []) + self._drain():
            request.push(EngineError("the engine is shut down"))

    def _drain(self) -> list[Request]:
        left: list[Request] = []
        while True:
            try:
                item = self._requests.get_nowait()
            except queue.Empty:
                return left
            if isinstance(item, Request):
                left.append(item)
