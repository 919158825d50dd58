"""The trajectory write-ahead log: durable answers, torn tails, full disks, compaction, readable records."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import httpx2
import pytest

from agentjet_client.protocol import Trajectory
from agentjet_server.errors import StateError
from agentjet_server.ingest.wal import Accepted, TrajectoryLog, read_records
from tests.server.ingest.trajectories import store, traj


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
    assert log.compact(keep_from_lsn=2, before_segment=third) == [1]  # segment 2 still holds lsn 2, 3
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


def test_compaction_keeps_the_newest_bodies_readable_and_evaluations_stay_known(tmp_path):
    s, log, buffered = store(tmp_path)
    evaluation = traj(9).model_copy(update={"purpose": "eval"})
    s.admit_batch([traj(0), traj(1), evaluation], version=0)
    log.rotate()
    s.admit_batch([traj(2), traj(3)], version=0)
    third = log.rotate()
    s.admit_batch([traj(4)], version=0)
    assert log.compact(keep_from_lsn=4, before_segment=third, keep_recent=3) == [1, 2]
    assert not list(tmp_path.glob("0000000[12].wal"))
    # the ids and signatures of everything, the bodies of the newest three compacted, then the live log
    assert [r.id for r in read_records(tmp_path, compacted=True)] == ["t0", "t1", "t9", "t2", "t3", "t4"]
    bodies = [r.id for r in read_records(tmp_path, recent=True) if r.trajectory is not None]
    assert bodies == ["t9", "t2", "t3", "t4"]
    assert [t for t, _ in buffered] == ["t0", "t1", "t2", "t3", "t4"]  # the evaluation was never buffered
    log.close()
    again, log2, _ = store(tmp_path)
    assert again.accepted == 5 and again.evaluated == 1
    assert [r.status for r in again.admit_batch([evaluation], version=0)] == ["duplicate"]
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
    # the bytes written before the failed fsync are gone: t0 once (its retry), t1 never
    assert [(r.lsn, r.id) for r in read_records(tmp_path) if isinstance(r, Accepted)] == [(0, "t0")]


FULL_DISK = """
import json, resource, sys
from pathlib import Path
from agentjet_server.errors import StateError
from tests.server.ingest.trajectories import store, traj

where = Path(sys.argv[1])
s, log, buffered = store(where)
s.admit(traj(0), version=0)
size = (where / "00000001.wal").stat().st_size
resource.setrlimit(resource.RLIMIT_FSIZE, (size + 100, resource.RLIM_INFINITY))  # the next record fits in part
answers = []
for i in (1, 2, 3):
    try:
        answers.append(s.admit(traj(i), version=0).status)
    except StateError as exc:
        answers.append("503: " + str(exc))
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))  # space freed
answers += [s.admit(traj(i), version=0).status for i in (2, 1)]
log.close()
print(json.dumps({"answers": answers, "buffered": buffered}))
"""


def test_a_write_a_full_disk_cuts_short_leaves_no_trace(tmp_path):
    """A real file-size limit (what a full disk does to a write): the record that only partly fits is
    answered with an error and cut off, so no later write can publish it under a reused sequence number."""
    root = Path(__file__).resolve().parents[3]
    proc = subprocess.run(
        [sys.executable, "-c", FULL_DISK, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert [a.split(":")[0] for a in out["answers"]] == ["503", "503", "503", "accepted", "accepted"]
    assert "File too large" in out["answers"][0]
    assert out["buffered"] == [["t0", 0], ["t2", 1], ["t1", 2]]
    logged = [(r.lsn, r.id) for r in read_records(tmp_path) if isinstance(r, Accepted)]
    assert logged == [(0, "t0"), (1, "t2"), (2, "t1")]  # each once, in answer order, no torn record
    s, log, _ = store(tmp_path)
    assert s.accepted == 3 and s.next_lsn == 3 and log.scan.torn_bytes == 0
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


def test_a_segment_that_cannot_be_opened_leaves_appends_in_the_current_one(tmp_path):
    """Rotation opens the new segment before letting the old one go: a read-only log dir makes the
    rotation (and so the checkpoint) fail, not every later append."""
    s, log, _ = store(tmp_path)
    s.admit(traj(0), version=0)
    (tmp_path / "00000002.wal").mkdir()  # the next segment's name is taken by something unwritable
    with pytest.raises(StateError, match="cannot open the trajectory log segment"):
        log.rotate()
    assert s.admit(traj(1), version=0).status == "accepted"  # still logged, in segment 1
    (tmp_path / "00000002.wal").rmdir()
    assert log.rotate() == 2
    assert s.admit(traj(2), version=0).status == "accepted"
    log.close()
    assert [r.id for r in read_records(tmp_path) if isinstance(r, Accepted)] == ["t0", "t1", "t2"]
    assert (tmp_path / "00000002.wal").stat().st_size > 0


def test_log_segments_are_readable_by_the_owner_only(tmp_path):
    s, log, _ = store(tmp_path / "log")
    s.admit(traj(0), version=0)
    log.close()
    assert stat.S_IMODE((tmp_path / "log").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "log" / "00000001.wal").stat().st_mode) == 0o600


def test_a_trajectory_logged_as_its_model_wrote_it_reads_back_as_the_same_record(tmp_path):
    """At ingest the log line embeds pydantic's own JSON (no dict, no json.dumps): what a restart
    reads is the trajectory that was accepted, token for token, and an evaluation likewise."""
    from agentjet_server.ingest.wal import Evaluated, decode, encode

    t = traj(3).model_copy(update={"metadata": {"note": "ünïcode ✓", "x": 0.1}, "task_tag": "math"})
    raw = t.model_dump_json().encode()
    fast = decode(encode(Accepted(7, t.id, (), raw=raw)))
    slow = decode(encode(Accepted(7, t.id, (), t.model_dump(mode="json"))))
    assert fast == slow and isinstance(fast, Accepted) and fast.lsn == 7
    assert Trajectory.model_validate(fast.trajectory) == t
    evaluation = decode(encode(Evaluated(t.id, (), raw=raw)))
    assert isinstance(evaluation, Evaluated) and Trajectory.model_validate(evaluation.trajectory) == t
    s, log, buffered = store(tmp_path)
    s.admit_batch([t], 0)
    log.close()
    assert buffered == [(t.id, 0)]
    [record] = [r for r in read_records(tmp_path) if isinstance(r, Accepted)]
    assert Trajectory.model_validate(record.trajectory) == t
