"""Helpers of the ingest tests: hand-made trajectories, and a store over a write-ahead log in a directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agentjet_client.protocol import Trajectory, Turn
from agentjet_server.ingest.store import TrajectoryStore
from agentjet_server.ingest.wal import TrajectoryLog


def traj(i: int, version: int = 0, token: int = 5, **fields: Any) -> Trajectory:
    """Trajectory ``t<i>`` of group ``task<i // 2>``: one turn sampled at ``version``, ``token`` its completion
    (``fields`` set the rest)."""
    turn = Turn(
        policy_version=version,
        prompt_token_ids=[1, 2, 3],
        completion_token_ids=[token],
        completion_logprobs=[-1.0],
        finish_reason="stop",
    )
    fields = {"task_id": f"task{i // 2}", "reward": float(i % 2), **fields}
    return Trajectory(id=f"t{i}", turns=[turn], **fields)


def store(path: Path, sink=None):  # type: ignore[no-untyped-def]
    """A store (vocabulary of 100, ``max_staleness`` 2) over the log in ``path``; what it buffered."""
    buffered: list[tuple[str, int]] = []
    log = TrajectoryLog(path)
    s = TrajectoryStore(100, 2, sink or (lambda t, n: buffered.append((t.id, n))), log)
    return s, log, buffered
