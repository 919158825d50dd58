"""The engine replicas' processes: started side by side, restarted when one dies, closed together.

A replica whose process dies is restarted in the background, with back-off, and loads the newest
weights (``latest``) before it takes requests again. A replica that sleeps through the learner's steps
(``--engine-sleep``) and dies during one is started again only after the step (``awake``), when its
device's memory is free. Calls to every replica (``each``: weights, sleep, wake) run side by side; a
replica found dead on the way is restarted rather than reported.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from agentjet_server.engine.remote import EngineProcess
from agentjet_server.engine.replica_routing import Replica
from agentjet_server.errors import EngineError

logger = logging.getLogger(__name__)

RESTART_BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0)

Target = tuple[Replica, EngineProcess]


class ReplicaProcesses:
    """The ``Replica`` records of one ``ReplicaSet`` and their engine processes. ``lock`` guards the
    records; ``closed`` is set once they are stopped for good."""

    def __init__(
        self,
        kind: str,
        model_path: Path,
        devices: Sequence[str],
        sleepers: Collection[int],
        *,
        threads: int | None,
        startup_timeout: float,
        engine_kwargs: Mapping[str, Any],
    ) -> None:
        """One replica per device in ``devices``, started side by side (each loads the model on its own);
        ``sleepers``: the indices of those that sleep through learner steps. ``engine_kwargs``: what
        each process's ``create_engine`` takes, but the device."""
        self.kind = kind
        self.model_path = model_path
        self.threads = threads
        self.startup_timeout = startup_timeout
        self._kwargs = dict(engine_kwargs)
        self.lock = threading.Lock()
        self.closed = threading.Event()
        self.awake = threading.Event()  # cleared while the sleepers sleep through a step
        self.awake.set()
        self.latest: tuple[Mapping[str, torch.Tensor], int] | None = None  # the newest weights, for restarts
        self.replicas = [Replica(i, device, sleeps=i in sleepers) for i, device in enumerate(devices)]
        with ThreadPoolExecutor(len(self.replicas)) as pool:
            engines = list(pool.map(self._start, self.replicas))
        for replica, engine in zip(self.replicas, engines, strict=True):
            replica.engine, replica.state = engine, "ready"

    def _start(self, replica: Replica) -> EngineProcess:
        version = self.latest[1] if self.latest is not None else int(self._kwargs.get("version", 0))
        kwargs = {**self._kwargs, "device": replica.device, "version": version}
        if replica.sleeps:
            kwargs["sleep_mode"] = True
        engine = EngineProcess(
            self.kind, self.model_path, startup_timeout=self.startup_timeout, threads=self.threads, **kwargs
        )
        logger.info("engine replica %d up on %s (pid %d)", replica.index, replica.device, engine.pid)
        return engine

    def ready(self, which: Callable[[Replica], bool] = lambda replica: True) -> list[Target]:
        """The ready replicas ``which`` picks, with their processes. Call it holding ``lock``."""
        return [(r, r.engine) for r in self.replicas if which(r) and r.state == "ready" and r.engine is not None]

    def each(self, targets: list[Target], call: Callable[[EngineProcess], None], *, wakes: bool) -> list[BaseException]:
        """``call`` on each target's process, side by side; the errors of the replicas that stay alive.
        One that died meanwhile is restarted instead (it loads the newest weights when it is back).
        ``wakes``: afterwards the replicas are awake (the call wakes a sleeping one)."""

        def one(target: Target) -> BaseException | None:
            replica, engine = target
            try:
                call(engine)
            except (EngineError, OSError) as exc:
                if engine.alive:
                    return exc
                self.restart(replica, engine)
            if wakes:
                replica.asleep = False
            return None

        with ThreadPoolExecutor(max(1, len(targets))) as pool:
            return [e for e in pool.map(one, targets) if e is not None]

    def restart_dead(self) -> None:
        """Restart the ready replicas whose process has died (idle, or asleep, so nobody noticed)."""
        for replica in self.replicas:
            engine = replica.engine
            if replica.state == "ready" and engine is not None and not engine.alive:
                self.restart(replica, engine)

    def restart(self, replica: Replica, dead: EngineProcess) -> None:
        """Start ``replica`` again in the background, in place of its process ``dead``."""
        with self.lock:
            if replica.engine is not dead or replica.state != "ready" or self.closed.is_set():
                return  # someone else restarts it already (or the server is stopping)
            replica.state = "restarting"
        threading.Thread(
            target=self._bring_back, args=(replica, dead), name=f"agentjet-replica-{replica.index}", daemon=True
        ).start()

    def _bring_back(self, replica: Replica, dead: EngineProcess) -> None:
        logger.warning("engine replica %d (pid %d) exited; restarting it", replica.index, dead.pid)
        dead.close()
        attempt = 0
        while not self.closed.is_set():
            engine: EngineProcess | None = None
            if replica.sleeps and not self.awake.is_set():
                self.awake.wait(1.0)  # the learner's step has its device: start it after the step
                continue
            try:
                engine = self._start(replica)
                while True:  # load the newest weights; an update may land meanwhile
                    with self.lock:
                        latest = self.latest
                    if latest is not None:
                        engine.update_weights(*latest)
                    with self.lock:
                        if self.latest is latest:
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

    def close(self) -> None:
        """Stop every replica's process, side by side; none is restarted after."""
        self.closed.set()
        with self.lock:
            engines = [r.engine for r in self.replicas if r.engine is not None]
            for r in self.replicas:
                r.state = "stopped"
        with ThreadPoolExecutor(max(1, len(engines))) as pool:
            list(pool.map(lambda e: e.close(), engines))
