"""The trajectory write-ahead log and the store over it: durable answers, torn tails, compaction."""

from __future__ import annotations

import os

import httpx2
import pytest

from agentjet_client.protocol import Trajectory, Turn
from agentjet_server.errors import StateError
from agentjet_server.store import TrajectoryStore
from agentjet_server.wal import TrajectoryLog


def traj(i: int, version: int = 0, token: int = 5) -> Trajectory:
    turn = Turn(
        policy_version=version,
        prompt_token_ids=[1, 2, 3],
        completion_token_ids=[token],
        completion_logprobs=[-1.0],
        finish_reason="stop",
    )
    return Trajectory(id=f"t{i}", task_id=f"task{i // 2}", turns=[turn], reward=float(i % 2))


def store(path, sink=None):  # type: ignore[no-untyped-def]
    buffered: list[tuple[str, int]] = []
    log = TrajectoryLog(path)
    s = TrajectoryStore(100, 2, sink or (lambda t, n: buffered.append((t.id, n))), log)
    return s, log, buffered


def test_answers_survive_a_restart(tmp_path):
    s, log, buffered = store(tmp_path)
    results = s.admit_batch([traj(0), traj(1), traj(0), traj(2, token=500), traj(3, version=9)], version=0)
    assert [r.status for r in results] == ["accepted", "accepted", "duplicate", "rejected", "rejected"]
    assert buffered == [("t0", 0), ("t1", 1)]
    s.record_version(1)
    log.close()

    again, log2, buffered2 = store(tmp_path)
    assert buffered2 == []  # the store does not buffer by itself; resume replays (see runtime)
    assert again.accepted == 2 and dict(again.rejected) == {"invalid_tokens": 1, "future_version": 1}
    assert again.next_lsn == 2 and again.known_version == 1
    assert set(log2.scan.trajectories) == {0, 1} and log2.scan.trajectories[1]["id"] == "t1"
    statuses = [r.status for r in again.admit_batch([traj(1), traj(2, token=500), traj(4)], version=1)]
    assert statuses == ["duplicate", "duplicate", "accepted"]  # the rejected id is known too
    assert buffered2 == [("t4", 2)]
    log2.close()


def test_a_version_published_before_a_restart_is_not_from_the_future(tmp_path):
    s, log, _ = store(tmp_path)
    s.record_version(7)
    log.close()
    again, log2, _ = store(tmp_path)
    # resumed at v3 (its checkpoint); trajectories sampled at v5 by the previous run are fine
    assert again.admit(traj(0, version=5), version=3).status == "accepted"
    assert again.admit(traj(1, version=8), version=3).status == "rejected"
    log2.close()


def test_a_torn_last_record_is_dropped_and_a_corrupt_middle_refuses(tmp_path):
    s, log, _ = store(tmp_path)
    s.admit_batch([traj(0), traj(1)], version=0)
    log.close()
    segment = tmp_path / "00000001.wal"
    whole = segment.read_bytes()
    segment.write_bytes(whole + whole.splitlines(keepends=True)[0][:40])  # a crash mid-append
    again, log2, _ = store(tmp_path)
    assert again.accepted == 2 and log2.scan.torn_bytes == 40
    assert segment.read_bytes() == whole  # truncated back to the last whole record
    log2.rotate()
    again.admit(traj(2), version=0)
    log2.close()
    lines = whole.splitlines(keepends=True)
    segment.write_bytes(lines[0][:20] + b"X" + lines[0][21:] + lines[1])  # damage in an older segment
    with pytest.raises(StateError, match="corrupt at byte 0"):
        TrajectoryLog(tmp_path)


def test_compaction_keeps_ids_and_counts(tmp_path):
    s, log, _ = store(tmp_path)
    s.admit_batch([traj(0), traj(1), traj(2, token=500)], version=0)
    second = log.rotate()
    s.admit_batch([traj(3), traj(4)], version=0)  # lsn 2, 3
    third = log.rotate()
    assert log.compact(keep_from_lsn=2, before_segment=third) == 1  # segment 2 still holds lsn 2, 3
    assert not (tmp_path / "00000001.wal").exists() and (tmp_path / "00000001.ids").exists()
    assert (tmp_path / f"{second:08d}.wal").exists()
    log.close()
    again, log2, _ = store(tmp_path)
    assert again.accepted == 4 and sum(again.rejected.values()) == 1 and again.next_lsn == 4
    assert sorted(log2.scan.trajectories) == [2, 3]
    assert [r.status for r in again.admit_batch([traj(0), traj(2), traj(5)], version=0)] == [
        "duplicate",
        "duplicate",
        "accepted",
    ]
    log2.close()


def test_a_failed_write_acknowledges_nothing(tmp_path, monkeypatch):
    s, log, buffered = store(tmp_path)

    def disk_full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(StateError, match="No space left on device"):
        s.admit_batch([traj(0), traj(1)], version=0)
    monkeypatch.undo()
    assert s.accepted == 0 and buffered == []
    assert [r.status for r in s.admit_batch([traj(0)], version=0)] == ["accepted"]  # the retry is not a duplicate
    log.close()


def test_http_answers_503_when_the_log_cannot_be_written(live_server, monkeypatch):
    body = {"trajectories": [traj(90).model_dump(mode="json")]}

    def broken(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", broken)
    r = httpx2.post(live_server.url + "/v1/trajectories", json=body)
    monkeypatch.undo()
    assert r.status_code == 503
    assert "Input/output error" in r.json()["error"]["message"] and "retry" in r.json()["error"]["message"]
    r = httpx2.post(live_server.url + "/v1/trajectories", json=body)
    assert r.json()["results"][0]["status"] == "accepted"
