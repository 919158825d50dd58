"""Several engine processes behind one ``Engine``: routing, weight fan-out, restarts, fail-over.

``agentjet-server up --engine-replicas N`` serves from N engine processes (``EngineProcess``), each
on its own device (``--engine-devices cuda:0,cuda:1``) or, on CPU, with its share of the cores.

Routing (``replica_routing``): among the replicas whose load is close to the least-loaded one's, a
request goes to the one that already saw the longest prefix of its prompt, so the calls of one
episode land where their KV prefix is cached.

Weights: an update is handed to every running replica at once (copied once into shared memory
that the updates reuse, in the engines' dtype, so each replica copies it once more: ``fanout``) and
returns when all have loaded it. The newest weights are kept, so a replica that restarts loads them
before it takes requests (``replica_processes``).

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
import dataclasses
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from agentjet_server.engine.base import (
    PROCESSED_SETTINGS,
    VLLM_PROCESSED_SETTINGS,
    Engine,
    SamplingParams,
    TokenEvent,
)
from agentjet_server.engine.fanout import SharedWeights
from agentjet_server.engine.replica_processes import ReplicaProcesses
from agentjet_server.engine.replica_routing import Replica, choose, prefix_blocks
from agentjet_server.errors import EngineError

logger = logging.getLogger(__name__)


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
        self._kind = kind
        self._fanout = SharedWeights(engine_kwargs.get("dtype"))
        self._updating = threading.Lock()  # one update at a time: they take the shared sets in turn
        self._processes = ReplicaProcesses(
            kind,
            self.model_path,
            [devices[i] if len(devices) > 1 else devices[0] for i in range(replicas)],
            sleepers,
            threads=threads,
            startup_timeout=startup_timeout,
            engine_kwargs=engine_kwargs,
        )
        self.max_context = min(e.max_context for _, e in self._processes.ready())

    @property
    def replicas(self) -> list[Replica]:
        """The replicas' records, in index order."""
        return self._processes.replicas

    # ----------------------------------------------------------------------------- routing

    async def _route(self, blocks: list[int], avoid: set[int]) -> Replica:
        processes = self._processes
        deadline = time.monotonic() + processes.startup_timeout
        while True:
            processes.restart_dead()  # one that died idle (or asleep) is noticed here
            with processes.lock:
                replica = choose(processes.replicas, blocks, avoid)
            if replica is not None:
                return replica
            if processes.closed.is_set():
                raise EngineError("the engine is shut down")
            if time.monotonic() > deadline:
                raise EngineError("no engine replica came back up; see the server log for why they failed")
            await asyncio.sleep(0.05)  # every replica is restarting

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> AsyncIterator[TokenEvent]:
        if self._processes.closed.is_set():
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
                with self._processes.lock:  # the next turn's prompt starts with this one's completion
                    replica.remember(prefix_blocks(prompt + produced))
                return
            except (EngineError, OSError):
                if engine.alive:
                    raise  # the replica is fine: the request itself failed
                replica.failovers += 1
                failed.add(replica.index)
                self._processes.restart(replica, engine)
                logger.warning(
                    "engine replica %d died with a request in flight; it goes on on another replica after %d tokens",
                    replica.index,
                    len(produced),
                )
            finally:
                with self._processes.lock:
                    replica.in_flight -= 1

    # ----------------------------------------------------------------------------- weights and sleep

    @property
    def processed_settings(self) -> frozenset[str]:
        # what its replicas' engine samples with
        return PROCESSED_SETTINGS if self._kind == "transformers" else VLLM_PROCESSED_SETTINGS

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        processes = self._processes
        with self._updating:
            weights = self._fanout.share(state_dict)  # also kept for a replica that restarts later
            with processes.lock:
                processes.latest = (weights, version)
                targets = processes.ready()
            # a sleeping replica wakes for it
            errors = processes.each(targets, lambda engine: engine.update_weights(weights, version), wakes=True)
            processes.awake.set()
            if errors:
                raise EngineError(f"loading weights v{version} failed on a replica: {errors[0]}")
            self._version = max(self._version, version)

    @property
    def can_sleep(self) -> bool:
        return any(r.sleeps for r in self.replicas)

    def sleep(self) -> None:
        """The sleepers free their device memory, side by side; returns when all have."""
        processes = self._processes
        with processes.lock:
            processes.awake.clear()
            targets = processes.ready(lambda replica: replica.sleeps)
            for replica, _engine in targets:
                replica.asleep = True  # routing avoids it from now on
        # one that died is started again once the step is over
        if errors := processes.each(targets, lambda engine: engine.sleep(), wakes=False):
            raise EngineError(f"an engine replica could not sleep: {errors[0]}")

    def wake(self) -> None:
        """Every sleeper serves again with the weights it had."""
        processes = self._processes
        with processes.lock:
            targets = processes.ready(lambda replica: replica.asleep)
        errors = processes.each(targets, lambda engine: engine.wake(), wakes=True)
        processes.awake.set()
        if errors:
            raise EngineError(f"an engine replica could not wake up: {errors[0]}")

    # ----------------------------------------------------------------------------- the rest

    def replica_status(self) -> list[dict[str, Any]]:
        with self._processes.lock:
            return [r.info() for r in self.replicas]

    def close(self) -> None:
        self._processes.close()


def cpu_threads_per_replica(replicas: int) -> int:
    """Each CPU replica's share of the machine's cores (at least one)."""
    return max(1, (os.cpu_count() or 1) // replicas)
