"""The state dir's mirror (``state.mirror``): on start the bucket is caught up with the disk (log bytes it lacks,
the newest checkpoint if its upload never finished), a bucket ahead of the disk is refused, the run's id and
signing key go up before anything is served, and a shutdown flushes the last checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentjet_server.errors import StateError
from agentjet_server.ingest.wal import TrajectoryLog
from agentjet_server.settings import ServerSettings
from agentjet_server.state.checkpoint import SAMPLE_KEY
from agentjet_server.state.mirror import StateMirror, covered, open_state_dir
from agentjet_server.state.objectstore import open_store, parse_part, part_key
from agentjet_server.state.restore import join_parts
from tests.server.ingest.trajectories import store as trajectory_store
from tests.server.ingest.trajectories import traj
from tests.server.state.runs import GROUP, GROUPS, K, push, runtime, wait_for


def settings(tmp_path: Path, **extra: object) -> ServerSettings:
    return ServerSettings(state_dir=tmp_path / "state", checkpoint_uri=f"file://{tmp_path}/bucket", **extra)  # type: ignore[arg-type]


def test_covered_counts_bytes_from_zero_without_a_gap():
    assert covered([]) == 0
    assert covered([(0, 10), (10, 20), (30, 40)]) == 20
    assert covered([(0, 10), (5, 25), (10, 20)]) == 25  # a retried put may overlap


def test_start_catches_the_bucket_up_with_the_log_on_disk(tmp_path):
    s, log, _ = trajectory_store(tmp_path / "state" / "log")  # a run that logged with no mirror (or lost it)
    s.admit_batch([traj(0), traj(1)], 0)
    log.rotate()
    s.admit_batch([traj(2)], 0)
    log.close()
    bucket = open_store(f"file://{tmp_path}/bucket")
    first = (tmp_path / "state" / "log" / "00000001.wal").read_bytes()
    bucket.put(part_key(1, 0, 40), first[:40])  # a part of segment 1 made it; the rest did not
    state = open_state_dir(settings(tmp_path, resume=True))
    log = TrajectoryLog(state.log_dir)
    mirror = StateMirror(bucket, state, settings(tmp_path, resume=True))
    try:
        mirror.attach(log)
        for number in (1, 2):
            parts = [(p[1], p[2], k) for k in bucket.list("log/") if (p := parse_part(k)) and p[0] == number]
            assert join_parts(bucket, parts) == (state.log_dir / f"{number:08d}.wal").read_bytes()
        mirror.upload_run_files(state.run_id)
        assert json.loads(bucket.get("RUN.json")) == {"run_id": state.run_id}
    finally:
        mirror.close(flush=False)
        log.close()
        state.close()


def test_a_bucket_ahead_of_the_disk_is_refused(tmp_path):
    s, log, _ = trajectory_store(tmp_path / "state" / "log")
    s.admit_batch([traj(0)], 0)
    log.close()
    size = (tmp_path / "state" / "log" / "00000001.wal").stat().st_size
    bucket = open_store(f"file://{tmp_path}/bucket")
    bucket.put(part_key(1, 0, size + 10), b"x" * (size + 10))  # the run went on elsewhere: this disk is stale
    state = open_state_dir(settings(tmp_path, resume=True))
    log = TrajectoryLog(state.log_dir)
    mirror = StateMirror(bucket, state, settings(tmp_path, resume=True))
    try:
        with pytest.raises(StateError, match="the state dir is older than the run"):
            mirror.attach(log)
    finally:
        mirror.close(flush=False)
        log.close()
        state.close()


def test_a_checkpoint_whose_upload_never_finished_goes_up_on_the_next_start(model_dir, trajectories, tmp_path):
    """The server checkpointed with no bucket (or died before uploading); restarted with one, the checkpoint goes up
    (and a clean shutdown flushes the last one, with the run's key)."""
    rt = runtime(model_dir, tmp_path / "state", checkpoint_every=K)
    push(rt, trajectories[: K * GROUP * GROUPS])
    wait_for(lambda: rt.loop.saved_step == K, "checkpoint K")
    rt.close(checkpoint=False)
    uri = f"file://{tmp_path}/bucket"
    again = runtime(model_dir, tmp_path / "state", checkpoint_every=K, resume=True, checkpoint_uri=uri)
    try:
        assert again.mirror is not None
        wait_for(lambda: again.mirror.last_uploaded_step == K, "the old checkpoint uploaded")  # type: ignore[union-attr]
    finally:
        again.close()  # a last checkpoint at step K again, flushed
    listing = open_store(uri).list()
    assert f"checkpoints/step-{K:08d}/MANIFEST.json" in listing and SAMPLE_KEY in listing
    assert json.loads(open_store(uri).get("RUN.json"))["run_id"] == again.run_id
