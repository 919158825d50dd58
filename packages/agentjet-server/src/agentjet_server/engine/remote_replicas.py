"""Engine replicas on other machines of the torchrun job (``--remote-replica-ranks``).

A rank named there hosts one replica (``ReplicaHost``): an ``EngineProcess`` on the rank's own device,
and a listener that serves it to rank 0 over TCP (``multiprocessing.connection``, authenticated with a
key rank 0 hands out over torch.distributed). Requests cross that connection; weights never do: each
update reaches the host ranks by a torch.distributed broadcast (NCCL on GPUs, gloo on CPU), which the
caller of ``RemoteReplicas`` provides as ``publish`` (the engine layer knows nothing of the learner),
and the host loads it into its engine with the same version number, so version tags stay exact.

On rank 0, ``RemoteReplicas`` puts the local engine (one engine, or a ``ReplicaSet``) and the remote
ones behind one ``Engine``: a request goes to the member with the fewest requests in flight (the local
engine on a tie), and one whose connection is gone is routed around. An update is loaded locally,
then published; the version moves once every host has it.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from multiprocessing.connection import Client, Listener
from pathlib import Path
from typing import Any

import torch

from agentjet_server.engine.base import Engine, SamplingParams, TokenEvent
from agentjet_server.engine.remote import EngineProcess, _serve_pipe
from agentjet_server.errors import EngineError

logger = logging.getLogger(__name__)


def reachable_address(peer: str, port: int) -> str:
    """This machine's address on the route to ``peer`` (rank 0's MASTER_ADDR): what rank 0 can connect to."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((peer, port or 1))  # no packet is sent: the kernel picks the route's source address
            return str(probe.getsockname()[0])
    except OSError:
        return socket.gethostbyname(socket.gethostname())


class ReplicaHost:
    """(a host rank) An engine replica served to rank 0: its process, and a listener on ``address``."""

    def __init__(self, kind: str, model_path: str | Path, authkey: bytes, peer: str, **engine_kwargs: Any) -> None:
        self.engine = EngineProcess(kind, model_path, **engine_kwargs)
        self._listener = Listener(("0.0.0.0", 0), authkey=authkey)
        port = int(self._listener.address[1])
        self.address = (reachable_address(peer, port), port)
        self._closed = threading.Event()
        threading.Thread(target=self._accept, name="agentjet-replica-host", daemon=True).start()
        logger.info("engine replica hosted at %s:%d (pid %d)", *self.address, self.engine.pid)

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn = self._listener.accept()
            except (OSError, EOFError):  # closed, or a peer without the key
                if self._closed.is_set():
                    return
                continue
            threading.Thread(target=self._serve, args=(conn,), name="agentjet-replica-conn", daemon=True).start()

    def _serve(self, conn: Any) -> None:
        conn.send(("ready", self.engine.max_context))
        try:
            asyncio.run(_serve_pipe(conn, self.engine, owns_engine=False))
        finally:
            conn.close()

    def update_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        self.engine.update_weights(weights, version)

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        self.engine.close()


class RemoteEngine(EngineProcess):
    """(rank 0) The engine of a ``ReplicaHost``, over its connection: generation only."""

    def __init__(self, address: tuple[str, int], authkey: bytes, model_path: str | Path, **engine_kwargs: Any) -> None:
        Engine.__init__(
            self,
            model_path,
            model_name=engine_kwargs.get("model_name"),
            chat_template=engine_kwargs.get("chat_template"),
            version=0,
        )
        self._engine_kwargs = {}
        self.address = address
        self._send_lock = threading.Lock()
        try:
            self._conn = Client(address, authkey=authkey)
            ready = self._conn.recv()
        except (OSError, EOFError) as exc:
            raise EngineError(f"cannot reach the engine replica at {address[0]}:{address[1]}: {exc}") from exc
        self._attach(int(ready[1]))

    @property
    def pid(self) -> int:
        return 0

    @property
    def alive(self) -> bool:
        return not self._closed.is_set()

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        raise EngineError("a remote replica takes its weights from the broadcast, not over its connection")

    def close(self) -> None:
        try:
            self._send(("close",))
        except OSError:
            pass
        self._conn.close()


class RemoteReplicas(Engine):
    """(rank 0) The local engine and the replicas on other ranks, used like one engine."""

    def __init__(
        self,
        local: Engine,
        remotes: Sequence[RemoteEngine],
        publish: Callable[[Mapping[str, torch.Tensor], int], None],
    ) -> None:
        super().__init__(local.model_path, model_name=local.model_name, version=0)
        self.local = local
        self.remotes = list(remotes)
        self.publish = publish
        self.max_context = min([local.max_context, *(r.max_context for r in self.remotes)])
        # the hosts start from the base model: until the first publish, the version is theirs (0), so a
        # resumed run gives every member the checkpoint's weights
        self._version = 0
        self._in_flight = [0] * (1 + len(self.remotes))
        self._served = [0] * (1 + len(self.remotes))

    @property
    def members(self) -> list[Engine]:
        return [self.local, *self.remotes]

    def _choose(self, avoid: set[int]) -> int:
        alive = [i for i, m in enumerate(self.members) if i not in avoid and (i == 0 or self.remotes[i - 1].alive)]
        if not alive:
            raise EngineError("no engine replica is reachable")
        return min(alive, key=lambda i: (self._in_flight[i], i))

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> AsyncIterator[TokenEvent]:
        failed: set[int] = set()
        while True:
            index = self._choose(failed)
            member = self.members[index]
            self._in_flight[index] += 1
            started = False
            try:
                async for event in member.generate(prompt_ids, params):
                    started = True
                    yield event
                self._served[index] += 1
                return
            except (EngineError, OSError):
                if started or index == 0 or self.remotes[index - 1].alive:
                    raise
                logger.warning("the engine replica at %s is gone; its request goes elsewhere", member.model_name)
                failed.add(index)
            finally:
                self._in_flight[index] -= 1

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        self.local.update_weights(state_dict, version)
        self.publish(state_dict, version)  # returns once every host rank has loaded it
        for remote in self.remotes:
            remote._version = max(remote._version, version)
        self._version = max(self._version, version)

    @property
    def processed_settings(self) -> frozenset[str]:
        return self.local.processed_settings

    @property
    def can_sleep(self) -> bool:
        return self.local.can_sleep

    def sleep(self) -> None:
        self.local.sleep()

    def wake(self) -> None:
        self.local.wake()

    def replica_status(self) -> list[dict[str, Any]]:
        local = self.local.replica_status() or [
            {"index": 0, "device": "local", "state": "ready", "version": self.local.version}
            | {"in_flight": self._in_flight[0], "requests": self._served[0]}
        ]
        out = list(local)
        for n, remote in enumerate(self.remotes, start=1):
            out.append(
                {
                    "index": len(local) + n - 1,
                    "device": f"remote {remote.address[0]}:{remote.address[1]}",
                    "state": "ready" if remote.alive else "stopped",
                    "version": remote.version,
                    "in_flight": self._in_flight[n],
                    "requests": self._served[n],
                }
            )
        return out

    def close(self) -> None:
        for remote in self.remotes:
            remote.close()
        self.local.close()
