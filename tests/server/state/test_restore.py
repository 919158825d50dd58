"""Restore (``state.restore``): a run mirrored to an object store comes back into an empty state dir.

On the real runtime and a local S3 server (moto): K steps and a checkpoint uploaded, more pushes acknowledged,
a crash, the state dir deleted; the run resumed from the bucket alone ends with the weights of one that never
stopped (Δw = 0), the same run id and signing key, and every acknowledged trajectory trained once. A checkpoint
whose upload died half-way (files, no manifest) is never chosen. On a directory store (fast): the start policy
(--fresh, a plain start, another run's state dir) and an interrupted restore, which is redone.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from agentjet_server.errors import StateError
from agentjet_server.ingest.wal import Accepted, TrajectoryLog, encode
from agentjet_server.runtime import SwarmRuntime
from agentjet_server.settings import ServerSettings
from agentjet_server.state.checkpoint import SAMPLE_KEY, StateDir
from agentjet_server.state.mirror import open_state_dir
from agentjet_server.state.objectstore import ObjectStore, open_store, part_key
from agentjet_server.state.restore import MARKER
from tests.server.state.runs import GROUP, GROUPS, K, max_diff, push, runtime, wait_for, weights

HALF = K * GROUP * GROUPS


@pytest.fixture(scope="module")
def straight(model_dir, trajectories, tmp_path_factory) -> dict[str, torch.Tensor]:
    """The weights of 2K steps straight through, no crash."""
    rt = runtime(model_dir, tmp_path_factory.mktemp("straight"), checkpoint_every=0)
    try:
        assert push(rt, trajectories) == ["accepted"] * len(trajectories)
        wait_for(lambda: rt.loop.learner.steps == 2 * K and rt.version == 2 * K, "2K steps, live")
        return weights(rt)
    finally:
        rt.close()


def mirrored(model_dir: Path, state_dir: Path, bucket, **extra: object) -> SwarmRuntime:  # type: ignore[no-untyped-def]
    return runtime(
        model_dir,
        state_dir,
        checkpoint_every=K,
        checkpoint_uri=bucket.uri("run"),
        checkpoint_store_options=bucket.options,
        **extra,
    )


def resume_from_the_bucket(model_dir, bucket, dead: SwarmRuntime, tmp_path, straight, trajectories):  # type: ignore[no-untyped-def]
    """The crashed run's state dir deleted, the run resumed from the bucket on a new one and trained to 2K steps:
    the checkks every restore test makes."""
    run_id, key = dead.run_id, (dead.state.root / SAMPLE_KEY).read_bytes()  # type: ignore[union-attr]
    shutil.rmtree(dead.state.root)  # type: ignore[union-attr]
    resumed = mirrored(model_dir, tmp_path / "new-machine", bucket, resume=True, start=False)
    try:
        assert resumed.run_id == run_id and (tmp_path / "new-machine" / SAMPLE_KEY).read_bytes() == key
        assert not (tmp_path / "new-machine" / MARKER).exists()
        # looked at before the learner starts: the replayed batches would move it on at once
        assert resumed.loop.learner.steps == K and resumed.version == K
        assert resumed.replayed == HALF  # everything acknowledged after the checkpoint came back from the bucket
        resumed.start()
        wait_for(
            lambda: (
                resumed.loop.learner.steps == 2 * K
                and resumed.version == 2 * K
                and resumed.store.trained == len(trajectories)
            ),  # counted a moment after the step is live
            "K more steps, counted",
        )
        diff = max_diff(weights(resumed), straight)
        print(f"restore from the bucket: max |w_restored - w_straight| = {diff:.3g} after {2 * K} steps")
        assert diff == 0.0
        assert resumed.store.trained == len(trajectories)
        # the seen ids came back too: a resend is a duplicate, not a second training
        assert push(resumed, trajectories[:3] + trajectories[-3:]) == ["duplicate"] * 6
        assert resumed.store.accepted == len(trajectories)
    finally:
        resumed.close()


def test_a_run_restored_from_the_bucket_equals_training_straight_through(
    model_dir, trajectories, tmp_path, s3_bucket, straight
):
    first = mirrored(model_dir, tmp_path / "machine", s3_bucket)
    assert push(first, trajectories[:HALF]) == ["accepted"] * HALF
    wait_for(lambda: first.status().learner.last_uploaded_step == K, "checkpoint K uploaded")
    assert first.snapshot().uploaded_step == K and first.status().learner.object_store_error is None
    assert push(first, trajectories[HALF:]) == ["accepted"] * HALF  # acknowledged: in the bucket, not checkpointed
    wait_for(lambda: first.loop.learner.steps >= K + 1, "a step past the checkpoint")
    first.close(checkpoint=False)  # the crash, and then the disk is lost
    listing = open_store(s3_bucket.uri("run"), s3_bucket.options).list()
    assert f"checkpoints/step-{K:08d}/MANIFEST.json" in listing and "RUN.json" in listing and SAMPLE_KEY in listing
    resume_from_the_bucket(model_dir, s3_bucket, first, tmp_path, straight, trajectories)


class DiesUploading(ObjectStore):
    """The bucket, until the upload of one checkpoint has put its first file: every later put of it fails."""

    def __init__(self, inner: ObjectStore, step: str) -> None:
        super().__init__(inner.fs, inner.root, inner.uri)
        self.step, self.puts = step, 0

    def put_file(self, key: str, path: Path) -> None:
        if self.step in key:
            self.puts += 1
            if self.puts > 1:
                raise StateError("the machine died mid-upload")
        super().put_file(key, path)


def test_a_checkpoint_whose_upload_died_is_never_chosen(model_dir, trajectories, tmp_path, s3_bucket, straight):
    first = mirrored(model_dir, tmp_path / "machine", s3_bucket)
    assert first.mirror is not None and first.mirror.uploader is not None
    push(first, trajectories[:HALF])
    wait_for(lambda: first.mirror.last_uploaded_step == K, "checkpoint K uploaded")  # type: ignore[union-attr]
    dying = DiesUploading(first.mirror.store, f"step-{2 * K:08d}")
    first.mirror.uploader.store = dying
    push(first, trajectories[HALF:])
    wait_for(lambda: dying.puts > 1, "the upload of checkpoint 2K to die")
    first.close(checkpoint=False)
    listing = open_store(s3_bucket.uri("run"), s3_bucket.options).list()
    half_uploaded = [k for k in listing if k.startswith(f"checkpoints/step-{2 * K:08d}/")]
    assert len(half_uploaded) == 1, half_uploaded  # one file, no manifest
    resume_from_the_bucket(model_dir, s3_bucket, first, tmp_path, straight, trajectories)


# -- the start policy, on a directory store ----------------------------------------------------------------------


def bucket_with_a_run(tmp_path: Path, run_id: str = "run-in-bucket") -> ObjectStore:
    """A store holding a run with two accepted trajectories in its log and no checkpoint."""
    store = open_store(f"file://{tmp_path}/bucket/run")
    store.put("RUN.json", json.dumps({"run_id": run_id}).encode())
    first, second = encode(Accepted(0, "t0", (), {"id": "t0"})), encode(Accepted(1, "t1", (), {"id": "t1"}))
    store.put(part_key(1, 0, len(first)), first)
    store.put(part_key(1, len(first), len(first) + len(second)), second)
    return store


def open_over(root: Path, store: ObjectStore, **flags: bool) -> StateDir:
    """The state dir ``root`` opened as ``up`` opens it, with the run mirrored to ``store``."""
    return open_state_dir(ServerSettings(state_dir=root, checkpoint_uri=store.uri, **flags))


def test_a_plain_start_over_a_run_in_the_bucket_is_refused(tmp_path):
    store = bucket_with_a_run(tmp_path)
    with pytest.raises(StateError, match=r"holds an earlier run \(run-in-bucket\); pass --resume"):
        open_over(tmp_path / "state", store)


def test_resume_restores_the_log_and_the_run_id(tmp_path):
    store = bucket_with_a_run(tmp_path)
    state = open_over(tmp_path / "state", store, resume=True)
    try:
        assert state.run_id == "run-in-bucket" and state.resuming and state.resumed is None
        log = TrajectoryLog(state.log_dir)
        assert sorted(log.scan.trajectories) == [0, 1] and log.scan.seen == {"t0", "t1"}
        log.close()
    finally:
        state.close()


def test_an_interrupted_restore_is_redone(tmp_path):
    store = bucket_with_a_run(tmp_path)
    root = tmp_path / "state"
    (root / "log").mkdir(parents=True)
    (root / "log" / "00000001.wal").write_bytes(b"half a restore")  # what the dead restore left
    (root / "run_id").write_text("half\n")
    (root / MARKER).write_text("s3://...\n")
    state = open_over(root, store, resume=True)
    try:
        assert not (root / MARKER).exists() and state.run_id == "run-in-bucket"
        log = TrajectoryLog(state.log_dir)
        assert log.scan.seen == {"t0", "t1"} and log.scan.torn_bytes == 0
        log.close()
    finally:
        state.close()


def test_fresh_deletes_the_run_in_the_bucket_too(tmp_path):
    store = bucket_with_a_run(tmp_path)
    state = open_over(tmp_path / "state", store, fresh=True)
    try:
        assert store.list() == {} and state.run_id != "run-in-bucket"
    finally:
        state.close()


def test_a_state_dir_of_another_run_is_refused(tmp_path):
    store = bucket_with_a_run(tmp_path)
    root = tmp_path / "state"
    (root / "log").mkdir(parents=True)
    (root / "log" / "00000001.wal").write_bytes(encode(Accepted(0, "x", (), {"id": "x"})))
    (root / "run_id").write_text("another-run\n")
    with pytest.raises(StateError, match=r"holds run another-run but --checkpoint-uri .* holds run run-in-bucket"):
        open_over(root, store, resume=True)
