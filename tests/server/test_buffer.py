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


def test_an_incomplete_group_is_trained_as_a_smaller_one_after_its_timeout():
    now = [100.0]
    buffer = GroupBuffer(group_size=4, batch_groups=1, group_timeout=60.0, clock=lambda: now[0])
    buffer.add(traj(0, "a"), lsn=0)
    buffer.add(traj(1, "a"), lsn=1)
    now[0] += 30
    buffer.add(traj(2, "b"), lsn=2)
    assert buffer.take_batch(timeout=0) is None  # nothing complete, nothing old enough
    now[0] += 31  # "a" opened 61 s ago, "b" 31 s ago
    batch = buffer.take_batch(timeout=0)
    assert batch is not None and [t.id for t in batch[0]] == ["t0", "t1"] and buffer.aged_out == 1
    buffer.commit()
    assert buffer.snapshot().open == [[2]] and buffer.buffered == 1
    buffer.add(traj(3, "a"), lsn=3)  # a late sibling opens a new group of its task
    assert buffer.snapshot().open == [[2], [3]]


def test_a_rejected_sibling_counts_towards_its_group_instead_of_holding_it_open():
    buffer = GroupBuffer(group_size=3, batch_groups=1, group_timeout=600.0)
    buffer.add(traj(0, "a"), lsn=0)
    buffer.add_absent("a")  # rejected as stale: it will never arrive
    assert buffer.take_batch(timeout=0) is None
    buffer.add(traj(1, "a"), lsn=1)
    batch = buffer.take_batch(timeout=0)  # two members and one absent: complete, no timeout needed
    assert batch is not None and [t.id for t in batch[0]] == ["t0", "t1"] and buffer.aged_out == 0
    buffer.commit()
    # absent before any sibling arrived; and a group whose every member was rejected trains nothing
    buffer.add_absent("b")
    assert buffer.snapshot().open == []  # nothing of "b" to checkpoint
    buffer.add(traj(2, "b"), lsn=2)
    buffer.add_absent("b")
    again = buffer.take_batch(timeout=0)
    assert again is not None and [t.id for t in again[0]] == ["t2"]
    buffer.commit()
    for _ in range(3):
        buffer.add_absent("c")
    assert buffer.take_batch(timeout=0) is None and buffer.groups == (0, 0) and buffer.buffered == 0


def test_the_runtime_closes_a_group_whose_sibling_was_rejected(model_dir, tmp_path):
    """A stale sibling is rejected at push; its group trains at once, not after group_timeout."""
    import json

    from tests.server.state.runs import make_trajectories, push, runtime, wait_for

    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    first, second = make_trajectories(vocab, 1)[:4], make_trajectories(vocab, 1, seed=1)[:4]
    rt = runtime(model_dir, tmp_path / "state", checkpoint_every=0, max_staleness=0, batch_groups=1)
    try:
        assert push(rt, first) == ["accepted"] * 4  # one group of 4 at version 0: one step
        wait_for(lambda: rt.version == 1, "the first step")
        late = [t.model_copy(update={"task_id": "late", "id": f"late-{i}"}) for i, t in enumerate(second)]
        fresh = [t.model_copy(update={"turns": [t.turns[0].model_copy(update={"policy_version": 1})]}) for t in late]
        assert push(rt, fresh[:3] + late[3:]) == ["accepted"] * 3 + ["rejected"]  # the last one is stale
        wait_for(lambda: rt.version == 2, "the group with a rejected sibling trained")
        assert rt.buffer.aged_out == 0
    finally:
        rt.close()


def test_the_buffer_counts_the_memory_it_holds():
    buffer = GroupBuffer(group_size=2, batch_groups=1)
    assert buffer.bytes == 0
    buffer.add(traj(0, "a"))
    buffer.add(traj(1, "a"))
    held = buffer.bytes
    assert held > 2000
    assert buffer.take_batch(timeout=0) is not None
    buffer.commit()
    assert buffer.bytes == 0


def test_a_full_buffer_answers_429_and_acknowledges_nothing(model_dir):
    import httpx2

    from tests.conftest import LiveServer

    server = LiveServer(model_dir, max_buffered=4, batch_groups=5, group_size=2, max_staleness=100)
    try:
        url = server.url + "/v1/trajectories"

        def body(*items: Trajectory) -> dict:  # type: ignore[type-arg]
            return {"trajectories": [t.model_dump(mode="json") for t in items]}

        first = httpx2.post(url, json=body(*(traj(i, f"g{i // 2}") for i in range(4))))
        assert [r["status"] for r in first.json()["results"]] == ["accepted"] * 4
        full = httpx2.post(url, json=body(traj(4, "g2")))
        assert full.status_code == 429 and int(full.headers["retry-after"]) >= 1
        error = full.json()["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == "buffer_full"
        assert "nothing was acknowledged" in error["message"] and "--max-buffered" not in error["message"]
        too_big = httpx2.post(url, json=body(*(traj(i, f"h{i}") for i in range(10, 15))))
        assert too_big.status_code == 413 and "--max-buffered" in too_big.json()["error"]["message"]
        counts = httpx2.get(server.url + "/v1/status").json()["trajectories"]
        assert counts["accepted"] == 4 and counts["buffered"] == 4  # the refused one was not taken
        retried = httpx2.post(url, json=body(traj(4, "g2"))).status_code
        assert retried == 429  # still full: the learner waits for 5 groups
    finally:
        server.stop()
