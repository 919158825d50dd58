"""An engine in a child process of its own, behind the same interface.

Why: vLLM's in-process engine core joins ``torch.distributed`` in whatever process hosts it. Under
torchrun, rank 0's process already belongs to the learner ranks' process group, so vLLM runs in a
spawned child instead, with torchrun's variables removed from its environment. Token streams and
weight updates cross one pipe each way; CPU tensors travel through shared memory (torch registers
its reductions with multiprocessing's pickler), so an update copies the weights once, into the
child's engine. Version tags stay exact: the child's engine tags every token with the weights that
produced it, and the parent forwards the tags unchanged.

    engine = EngineProcess("vllm", model_path, device="cpu")   # then use it like any Engine
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import signal
import threading
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import aclosing
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing

from agentjet_server.engine.base import Engine, SamplingParams, TokenEvent
from agentjet_server.engine.handoff import TokenStream
from agentjet_server.errors import EngineError, InvalidRequestError, ModelLoadError, RequestError

logger = logging.getLogger(__name__)

# what torchrun puts in the environment; the child must not look like a rank
_SPAWN_LOCK = threading.Lock()

_LAUNCHER_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_ERROR_FILE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
)


class EngineProcess(Engine):
    def __init__(
        self,
        kind: str,
        model_path: str | Path,
        *,
        startup_timeout: float = 600.0,
        threads: int | None = None,
        **engine_kwargs: Any,
    ) -> None:
        """``threads``: the child's OpenMP / torch threads (its share of the cores; None: the default)."""
        super().__init__(
            model_path,
            model_name=engine_kwargs.get("model_name"),
            chat_template=engine_kwargs.get("chat_template"),
            version=int(engine_kwargs.get("version", 0)),
        )
        self._engine_kwargs = dict(engine_kwargs)
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self._send_lock = threading.Lock()
        self._process = context.Process(
            target=_child_main,
            args=(child_conn, kind, str(self.model_path), engine_kwargs),
            name=f"agentjet-{kind}-engine",
        )
        with _SPAWN_LOCK:  # the child's thread count must be in its environment before torch loads
            saved = os.environ.get("OMP_NUM_THREADS")
            if threads is not None:
                os.environ["OMP_NUM_THREADS"] = str(threads)
            try:
                self._process.start()
            finally:
                if threads is not None:
                    if saved is None:
                        os.environ.pop("OMP_NUM_THREADS", None)
                    else:
                        os.environ["OMP_NUM_THREADS"] = saved
        child_conn.close()
        if not self._conn.poll(startup_timeout):
            self._process.kill()
            raise ModelLoadError(f"the {kind} engine process did not start within {startup_timeout:.0f}s")
        ready = self._conn.recv()
        if ready[0] != "ready":
            self._process.join(timeout=10)
            raise ModelLoadError(f"the {kind} engine process failed to start: {ready[1]}")
        self._attach(int(ready[1]))

    def _attach(self, max_context: int) -> None:
        """Start reading the connection (``_conn``) to an engine that said it is ready."""
        self.max_context = max_context
        self._streams: dict[int, TokenStream] = {}
        self._updates: dict[int, tuple[threading.Event, list[str | None]]] = {}
        self._ids = itertools.count()
        self._closed = threading.Event()
        self._reader = threading.Thread(target=self._read, name="agentjet-engine-pipe", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return int(self._process.pid or 0)

    @property
    def alive(self) -> bool:
        """Whether the child process is running and its pipe is open."""
        return self._process.is_alive() and not self._closed.is_set()

    def _send(self, message: tuple[Any, ...]) -> None:
        with self._send_lock:
            self._conn.send(message)

    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            kind = message[0]
            if kind == "event":
                stream = self._streams.get(message[1])
                if stream is not None:
                    stream.push(message[2])
                    if message[2].finish_reason is not None:
                        self._streams.pop(message[1], None)
            elif kind in ("error", "refused"):  # refused: the request's own settings (a 400, as in process)
                stream = self._streams.pop(message[1], None)
                if stream is not None and kind == "refused":
                    stream.push(InvalidRequestError(message[2], param=message[3]))
                elif stream is not None:
                    stream.push(EngineError(message[2]))
            elif kind == "updated":
                done, error = self._updates.pop(message[1])
                error.append(message[2])
                done.set()
        self._closed.set()
        for stream in list(self._streams.values()):
            stream.push(EngineError("the engine process exited"))
        for done, error in list(self._updates.values()):
            error.append("the engine process exited")
            done.set()

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> AsyncIterator[TokenEvent]:
        if self._closed.is_set():
            raise EngineError("the engine process is not running")
        request_id = next(self._ids)
        stream = TokenStream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        self._send(("generate", request_id, list(prompt_ids), params))

        def abandoned() -> None:  # the child's engine frees its place in the batch
            if not self._closed.is_set():
                self._streams.pop(request_id, None)
                self._send(("abort", request_id))

        async with aclosing(stream.until_finished(abandoned)) as events:
            async for event in events:
                yield event

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        update_id = next(self._ids)
        done, error = threading.Event(), list[str | None]()
        self._updates[update_id] = (done, error)
        weights = {name: tensor.detach().cpu() for name, tensor in state_dict.items()}
        self._send(("update", update_id, weights, version))
        done.wait()
        if error[0] is not None:
            raise EngineError(f"loading weights v{version} in the engine process failed: {error[0]}")
        self._version = max(self._version, version)

    @property
    def can_sleep(self) -> bool:
        return bool(self._engine_kwargs.get("sleep_mode"))

    def sleep(self) -> None:
        self._call("sleep")

    def wake(self) -> None:
        self._call("wake")

    def _call(self, method: str) -> None:
        """``method`` of the child's engine (no arguments), waited for like an update."""
        call_id = next(self._ids)
        done, error = threading.Event(), list[str | None]()
        self._updates[call_id] = (done, error)
        self._send(("call", call_id, method))
        done.wait()
        if error[0] is not None:
            raise EngineError(f"the engine process could not {method}: {error[0]}")

    def close(self) -> None:
        if self._process.is_alive():
            try:
                self._send(("close",))
            except OSError:
                pass
            self._process.join(timeout=30)
            if self._process.is_alive():
                self._process.kill()
        self._conn.close()


def _child_main(conn: Any, kind: str, model_path: str, engine_kwargs: dict[str, Any]) -> None:
    # the parent stops this process (a "close" message, or the pipe closing when it dies);
    # Ctrl-C / SIGTERM to the process group must not kill the engine under a step in flight
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    for name in _LAUNCHER_VARS:
        os.environ.pop(name, None)
    try:
        from agentjet_server.engine import create_engine

        engine = create_engine(kind, Path(model_path), **engine_kwargs)  # type: ignore[arg-type]
    except Exception as exc:  # reported to the parent, which raises it as a start-up error
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", engine.max_context))
    asyncio.run(_serve_pipe(conn, engine))


async def _serve_pipe(conn: Any, engine: Any, owns_engine: bool = True) -> None:
    """Serve ``engine`` over ``conn`` until it closes; ``owns_engine``: close the engine then too (a
    connection from another machine to a replica host's engine does not)."""
    loop = asyncio.get_running_loop()
    send_lock = threading.Lock()
    tasks: dict[int, asyncio.Task[None]] = {}
    inbox: asyncio.Queue[tuple[Any, ...]] = asyncio.Queue()

    def send(message: tuple[Any, ...]) -> None:
        with send_lock:
            conn.send(message)

    def read() -> None:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                message = ("close",)
            loop.call_soon_threadsafe(inbox.put_nowait, message)
            if message[0] == "close":
                return

    async def run(request_id: int, prompt_ids: list[int], params: SamplingParams) -> None:
        try:
            async for event in engine.generate(prompt_ids, params):
                send(("event", request_id, event))
        except asyncio.CancelledError:
            raise
        except RequestError as exc:
            send(("refused", request_id, exc.message, exc.param))
        except Exception as exc:
            send(("error", request_id, str(exc)))
        finally:
            tasks.pop(request_id, None)

    def update(update_id: int, weights: dict[str, torch.Tensor], version: int) -> None:
        try:
            engine.update_weights(weights, version)
            send(("updated", update_id, None))
        except Exception as exc:
            send(("updated", update_id, f"{type(exc).__name__}: {exc}"))

    def call(call_id: int, method: str) -> None:
        try:
            getattr(engine, method)()
            send(("updated", call_id, None))
        except Exception as exc:
            send(("updated", call_id, f"{type(exc).__name__}: {exc}"))

    threading.Thread(target=read, name="agentjet-engine-pipe", daemon=True).start()
    while True:
        message = await inbox.get()
        if message[0] == "generate":
            tasks[message[1]] = asyncio.create_task(run(message[1], message[2], message[3]))
        elif message[0] == "abort":
            task = tasks.get(message[1])
            if task is not None:
                task.cancel()
        elif message[0] == "update":
            threading.Thread(target=update, args=message[1:], daemon=True).start()
        elif message[0] == "call" and message[2] in ("sleep", "wake"):
            threading.Thread(target=call, args=message[1:], daemon=True).start()
        elif message[0] == "close":
            for task in tasks.values():
                task.cancel()
            if owns_engine:
                engine.close()
            return
