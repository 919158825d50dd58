"""Several engine processes behind one ``Engine``: routing, weight fan-out, restarts, fail-over.

``agentjet-server up --engine-replicas N`` serves from N engine processes (``EngineProcess``), each
on its own device (``--engine-devices cuda:0,cuda:1``) or, on CPU, with its share of the cores.

Routing: among the replicas whose load (requests in flight) is within a small margin of the
least-loaded one's, a request goes to the one that already saw the longest prefix of its prompt
(chained hashes of 32-token blocks of earlier prompts and their completions, remembered per
replica); among equals to the least loaded, then to the one remembering the fewest blocks. So the
calls of one episode, whose prompts extend each other, land where their KV prefix is cached
(vLLM's prefix cache), and the load margin spreads requests that share a prefix (a GRPO group, a
common system prompt) once one replica has its share.

Weights: an update is handed to every running replica at once (copied once into shared memory
that the updates reuse, in the engines' dtype, so each replica copies it once more) and returns
when all have loaded it. The newest weights are kept, so a replica that restarts loads them before
it takes requests.

Sleep (``--engine-sleep``, vLLM): the replicas that share a device with a learner rank (all of them
on CPU) sleep through each learner step and wake with its weights; the others serve on, and while
the sleepers sleep every request goes to an awake replica when there is one. A sleeper that dies
while its device's learner steps is started again only after the step, when its memory is free.

Failures: a replica whose process dies is restarted in the background (with back-off). A request
it was serving continues on another replica from where it stopped: the tokens already streamed
stay (each keeps the version tag of the weights that sampled it), and the rest are sampled with
the prompt plus those tokens. Such a continuation is not reproducible from the request's seed, and
a stop string split across the two halves is not seen.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from agentjet_server.engine.base import Engine, SamplingParams, TokenEvent
from agentjet_server.engine.remote import EngineProcess
from agentjet_server.errors import EngineError

logger = logging.getLogger(__name__)

BLOCK = 32  # tokens per prefix block for affinity
REMEMBERED_BLOCKS = 50_000  # per replica, least recently used forgotten first
RESTART_BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0)


def prefix_blocks(token_ids: Sequence[int]) -> list[int]:
    """Chained hashes of the prompt's full ``BLOCK``-token blocks: equal hashes, equal prefixes."""
    out: list[int] = []
    chained = 0
    for start in range(0, len(token_ids) - BLOCK + 1, BLOCK):
        chained = hash((chained, tuple(token_ids[start : start + BLOCK])))
        out.append(chained)
    return out


@dataclasses.dataclass
class Replica:
    index: int
    device: str
    engine: EngineProcess | None = None
    state: str = "starting"  # starting, ready, restarting, stopped
    in_flight: int = 0
    requests: int = 0
    tokens: int = 0
    restarts: int = 0
    failovers: int = 0  # requests that died with this replica and went on elsewhere
    sleeps: bool = False  # --engine-sleep: it sleeps through every learner step
    asleep: bool = False
    blocks: collections.OrderedDict[int, None] = dataclasses.field(default_factory=collections.OrderedDict)

    def matched(self, blocks: list[int]) -> int:
        n = 0
        for block in blocks:
            if block not in self.blocks:
                break
            n += 1
        return n

    def remember(self, blocks: list[int]) -> None:
        for block in blocks:
            self.blocks[block] = None
            self.blocks.move_to_end(block)
        while len(self.blocks) > REMEMBERED_BLOCKS:
            self.blocks.popitem(last=False)

    def info(self) -> dict[str, Any]:
        engine = self.engine
        return {
            "index": self.index,
            "device": self.device,
            "state": self.state,
            "pid": engine.pid if engine is not None else None,
            "version": engine.version if engine is not None else None,
            "in_flight": self.in_flight,
            "requests": self.requests,
            "tokens": self.tokens,
            "restarts": self.restarts,
            "failovers": self.failovers,
            "sleeps": self.sleeps,
            "asleep": self.asleep,
        }


_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class ReplicaSet(Engine):
    """N ``EngineProcess`` replicas of one model, used like a single engine."""

    def __init__(
        self,
        kind: str,
        model_path: str | Path,
        *,
        replicas: int,
        devices: Sequence[str],
        threads: int | None = None,
        startup_timeout: float = 600.0,
        sleepers: Collection[int] = (),
        **engine_kwargs: Any,
    ) -> None:
        """``sleepers``: the replicas that sleep through learner steps (vLLM's sleep mode)."""
        if replicas < 1:
            raise ValueError("replicas must be at least 1")
        if len(devices) not in (1, replicas):
            raise ValueError(f"{len(devices)} engine devices for {replicas} replicas: name one, or one per replica")
        super().__init__(
            model_path,
            model_name=engine_kwargs.get("model_name"),
            chat_template=engine_kwargs.get("chat_template"),
            version=int(engine_kwargs.get("version", 0)),
        )
        self.kind = kind
        self._kwargs = engine_kwargs
        self._threads = threads
        self._startup_timeout = startup_timeout
        self._lock = threading.Lock()
        self._latest: tuple[Mapping[str, torch.Tensor], int] | None = None  # the newest weights, for restarts
        # two sets of shared-memory tensors, written in turn by the updates (see _shared)
        self._buffers: list[dict[str, torch.Tensor]] = [{}, {}]
        self._updating = threading.Lock()  # one update at a time: they take the sets in turn
        self._wire_dtype = _DTYPES.get(str(engine_kwargs.get("dtype")))
        self._closed = threading.Event()
        self._awake = threading.Event()  # cleared while the sleepers sleep through a step
        self._awake.set()
        self.replicas = [
            Replica(i, devices[i] if len(devices) > 1 else devices[0], sleeps=i in sleepers) for i in range(replicas)
        ]
        # start them side by side: each loads the model on its own
        with ThreadPoolExecutor(replicas) as pool:
            engines = list(pool.map(self._start, self.replicas))
        for replica, engine in zip(self.replicas, engines, strict=True):
            replica.engine, replica.state = engine, "ready"
        self.max_context = min(e.max_context for e in engines)

    def _start(self, replica: Replica) -> EngineProcess:
        kwargs = {**self._kwargs, "device": replica.device, "version": self._version}
        if replica.sleeps:
            kwargs["sleep_mode"] = True
        engine = EngineProcess(
            self.kind, self.model_path, startup_timeout=self._startup_timeout, threads=self._threads, **kwargs
        )
        logger.info("engine replica %d up on %s (pid %d)", replica.index, replica.device, engine.pid)
        return engine

    # ----------------------------------------------------------------------------- routing

    def _choose(self, blocks: list[int], avoid: set[int]) -> Replica | None:
        for replica in self.replicas:  # one that died idle (or asleep) is noticed here
            engine = replica.engine
            if replica.state == "ready" and engine is not None and not engine.alive:
                self._restart(replica, engine)
        with self._lock:
            ready = [r for r in self.replicas if r.state == "ready" and r.index not in avoid]
            if not ready:
                ready = [r for r in self.replicas if r.state == "ready"]
            if not ready:
                return None
            awake = [r for r in ready if not r.asleep]
            ready = awake or ready  # a sleeper holds its requests until the step ends
            least = min(r.in_flight for r in ready)
            margin = max(2, least // 4)  # affinity wins only while the load stays close
            near = [r for r in ready if r.in_flight <= least + margin]
            # the longest cached prefix; among equals the least loaded, then the one caching least
            best = min(near, key=lambda r: (-r.matched(blocks), r.in_flight, len(r.blocks), r.requests))
            best.remember(blocks)
            best.in_flight += 1
            best.requests += 1
            return best

    async def _route(self, blocks: list[int], avoid: set[int]) -> Replica:
        deadline = time.monotonic() + self._startup_timeout
        while True:
            replica = self._choose(blocks, avoid)
            if replica is not None:
                return replica
            if self._closed.is_set():
                raise EngineError("the engine is shut down")
            if time.monotonic() > deadline:
                raise EngineError("no engine replica came back up; see the server log for why they failed")
            await asyncio.sleep(0.05)  # every replica is restarting

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> AsyncIterator[TokenEvent]:
        if self._closed.is_set():
            raise EngineError("the engine is shut down")
        prompt = list(prompt_ids)
        produced: list[int] = []
        failed: set[int] = set()
        while True:
            replica = await self._route(prefix_blocks(prompt + produced), failed)
            engine = replica.engine
            assert engine is not None
            left = params if not produced else dataclasses.replace(params, max_tokens=params.max_tokens - len(produced))
            try:
                async for event in engine.generate(prompt + produced, left):
                    produced.append(event.token_id)
                    replica.tokens += 1
                    yield event
                with self._lock:  # the next turn's prompt starts with this one's completion
                    replica.remember(prefix_blocks(prompt + produced))
                return
            except (EngineError, OSError):
                if engine.alive:
                    raise  # the replica is fine: the request itself failed
                replica.failovers += 1
                failed.add(replica.index)
                self._restart(replica, engine)
                logger.warning(
                    "engine replica %d died with a request in flight; it goes on on another replica after %d tokens",
                    replica.index,
                    len(produced),
                )
            finally:
                with self._lock:
                    replica.in_flight -= 1

    # ----------------------------------------------------------------------------- weights

    def _shared(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The update in shared memory, one copy for every replica, in the engines' dtype (they would
        convert it anyway; bf16 halves what is copied). The tensors are allocated by the first two
        updates and reused: moving fresh tensors into shared memory cost 1.7 s for a 147M-parameter
        model here, most of it faulting in new pages, against a plain copy into pages already
        mapped. Two sets, written in turn, so the newest weights stay whole while the next update
        writes; a restarting replica that read a set while it was rewritten sees ``_latest`` change
        and loads again."""
        spare = self._buffers[0]
        self._buffers.reverse()
        out = {}
        for name, tensor in state_dict.items():
            source = tensor.detach()
            dtype = self._wire_dtype if self._wire_dtype is not None and source.is_floating_point() else source.dtype
            buffer = spare.get(name)
            if buffer is None or buffer.shape != source.shape or buffer.dtype != dtype:
                buffer = torch.empty(source.shape, dtype=dtype).share_memory_()  # type: ignore[no-untyped-call]
                spare[name] = buffer
            buffer.copy_(source)
            out[name] = buffer
        return out

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        with self._updating:
            self._update(state_dict, version)

    def _update(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        weights = self._shared(state_dict)  # also kept for a replica that restarts later
        with self._lock:
            self._latest = (weights, version)
            targets = [(r, r.engine) for r in self.replicas if r.state == "ready" and r.engine is not None]

        def load(item: tuple[Replica, EngineProcess]) -> BaseException | None:
            replica, engine = item
            try:
                engine.update_weights(weights, version)  # a sleeping replica wakes for it
            except (EngineError, OSError) as exc:
                if engine.alive:
                    return exc
                self._restart(replica, engine)  # it loads the newest weights when it is back
            replica.asleep = False
            return None

        errors = self._each(load, targets)
        self._awake.set()
        if errors:
            raise EngineError(f"loading weights v{version} failed on a replica: {errors[0]}")
        self._version = max(self._version, version)

    # ----------------------------------------------------------------------------- sleep

    @property
    def can_sleep(self) -> bool:
        return any(r.sleeps for r in self.replicas)

    def sleep(self) -> None:
        """The sleepers free their device memory, side by side; returns when all have."""
        with self._lock:
            self._awake.clear()
            targets = [(r, r.engine) for r in self.replicas if r.sleeps and r.state == "ready" and r.engine]
            for replica, _engine in targets:
                replica.asleep = True  # routing avoids it from now on

        def fall_asleep(item: tuple[Replica, EngineProcess]) -> BaseException | None:
            replica, engine = item
            try:
                engine.sleep()
            except (EngineError, OSError) as exc:
                if engine.alive:
                    return exc
                self._restart(replica, engine)  # started again once the step is over
            return None

        errors = self._each(fall_asleep, targets)
        if errors:
            raise EngineError(f"an engine replica could not sleep: {errors[0]}")

    def wake(self) -> None:
        """Every sleeper serves again with the weights it had."""
        with self._lock:
            targets = [(r, r.engine) for r in self.replicas if r.asleep and r.state == "ready" and r.engine]

        def wake_up(item: tuple[Replica, EngineProcess]) -> BaseException | None:
            replica, engine = item
            try:
                engine.wake()
            except (EngineError, OSError) as exc:
                if engine.alive:
                    return exc
                self._restart(replica, engine)
            replica.asleep = False
            return None

        errors = self._each(wake_up, targets)
        self._awake.set()
        if errors:
            raise EngineError(f"an engine replica could not wake up: {errors[0]}")

    @staticmethod
    def _each(
        action: Callable[[tuple[Replica, EngineProcess]], BaseException | None],
        targets: list[tuple[Replica, EngineProcess]],
    ) -> list[BaseException]:
        with ThreadPoolExecutor(max(1, len(targets))) as pool:
            return [e for e in pool.map(action, targets) if e is not None]

    # ----------------------------------------------------------------------------- restarts

    def _restart(self, replica: Replica, dead: EngineProcess) -> None:
        with self._lock:
            if replica.engine is not dead or replica.state != "ready" or self._closed.is_set():
                return  # someone else restarts it already (or the server is stopping)
            replica.state = "restarting"
        threading.Thread(
            target=self._bring_back, args=(replica, dead), name=f"agentjet-replica-{replica.index}", daemon=True
        ).start()

    def _bring_back(self, replica: Replica, dead: EngineProcess) -> None:
        logger.warning("engine replica %d (pid %d) exited; restarting it", replica.index, dead.pid)
        dead.close()
        attempt = 0
        while not self._closed.is_set():
            engine: EngineProcess | None = None
            if replica.sleeps and not self._awake.is_set():
                self._awake.wait(1.0)  # the learner's step has its device: start it after the step
                continue
            try:
                engine = self._start(replica)
                while True:  # load the newest weights; an update may land meanwhile
                    with self._lock:
                        latest = self._latest
                    if latest is not None:
                        engine.update_weights(*latest)
                    with self._lock:
                        if self._latest is latest:
                            replica.engine, replica.state = engine, "ready"
                            replica.asleep = False
                            replica.restarts += 1
                            replica.blocks.clear()
                            logger.info("engine replica %d is back (pid %d)", replica.index, engine.pid)
                            return
            except Exception:
                logger.exception("restarting engine replica %d failed", replica.index)
                if engine is not None:
                    engine.close()
            time.sleep(RESTART_BACKOFF_S[min(attempt, len(RESTART_BACKOFF_S) - 1)])
            attempt += 1

    # ----------------------------------------------------------------------------- the rest

    def replica_status(self) -> list[dict[str, Any]]:
        with self._lock:
            return [r.info() for r in self.replicas]

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            engines = [r.engine for r in self.replicas if r.engine is not None]
            for r in self.replicas:
                r.state = "stopped"
        with ThreadPoolExecutor(max(1, len(engines))) as pool:
            list(pool.map(lambda e: e.close(), engines))


def cpu_threads_per_replica(replicas: int) -> int:
    """Each CPU replica's share of the machine's cores (at least one)."""
    return max(1, (os.cpu_count() or 1) // replicas)
