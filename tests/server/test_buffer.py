"""The group buffer: complete groups in order; a batch being trained stays in checkpoints until committed."""

from __future__ import annotations

import pytest

from agentjet_client.protocol import Trajectory, Turn
from agentjet_server.batching.buffer import GroupBuffer


def traj(i: int, task: str) -> Trajectory:
    turn = Turn(
        policy_version=0,
        prompt_token_ids=[1],
        completion_token_ids=[2],
        completion_logprobs=[-1.0],
        finish_reason="stop",
    )
    return Trajectory(id=f"t{i}", task_id=task, turns=[turn], reward=float(i % 2))


def test_a_batch_is_in_snapshots_until_committed_and_comes_back_first_when_put_back():
    buffer = GroupBuffer(group_size=2, batch_groups=1)
    for i, task in enumerate(["a", "b", "a", "b", "c"]):
        buffer.add(traj(i, task), lsn=i)
    batch = buffer.take_batch(timeout=0)
    assert batch is not None and [t.id for t in batch[0]] == ["t0", "t2"]
    assert buffer.snapshot().ready == [[0, 2], [1, 3]] and buffer.snapshot().open == [[4]]
    assert buffer.buffered == 3  # waiting to be trained: the taken batch is not counted
    with pytest.raises(RuntimeError, match="neither committed nor put back"):
        buffer.take_batch(timeout=0)
    buffer.put_back()
    again = buffer.take_batch(timeout=0)
    assert again is not None and [t.id for t in again[0]] == ["t0", "t2"]
    buffer.commit()
    assert buffer.snapshot().ready == [[1, 3]]
    nxt = buffer.take_batch(timeout=0)
    assert nxt is not None and [t.id for t in nxt[0]] == ["t1", "t3"]
