"""Recovery (``state.recovery``): a checkpoint records the buffer, the log position, the training settings
and the live configuration together, and compacts the log segments it made redundant; resume puts back what
the checkpoint had buffered and everything logged after it, in log order, and refuses a log that lost what it
needs; the live configuration comes back from the log's newest change or else the checkpoint. On the real
runtime: a run that crashed and resumed ends with the weights of one that never stopped.

The exactness test: K steps, checkpoint, a "crash" a little later (the learner is stopped with no
final checkpoint, so steps after K are lost), resume, K more; versus 2K steps straight on the same
trajectories. The weights must agree within 1e-6 (CPU, fp32), so resume neither skips nor repeats
a trajectory, and restores the optimizer exactly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentjet_server.batching.buffer import GroupBuffer
from agentjet_server.engine.hf import TransformersEngine
from agentjet_server.errors import StateError
from agentjet_server.ingest.store import TrajectoryStore
from agentjet_server.ingest.wal import Configured, TrajectoryLog
from agentjet_server.learner.batch import build_batch
from agentjet_server.learner.loop import TrainingLoop
from agentjet_server.learner.trainer import Learner, LearnerConfig
from agentjet_server.runtime import SwarmRuntime
from agentjet_server.state.checkpoint import CheckpointMeta, StateDir
from agentjet_server.state.recovery import LiveConfiguration, Recovery, restored_configuration
from tests.server.ingest.trajectories import traj
from tests.server.state.runs import GROUP, GROUPS, K, critic, max_diff, push, runtime, wait_for, weights

SETTINGS = {"lr": 0.5, "group_size": 2, "batch_groups": 1, "port": 8000}


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[TransformersEngine]:
    served = TransformersEngine(model_dir)
    yield served
    served.close()


class Run:
    """What ``Recovery`` works over, opened on a state dir as the runtime opens it (no server, no learner
    thread): groups of two, a store over the log, a learner and its loop."""

    def __init__(self, model_dir: Path, engine: TransformersEngine, root: Path, resume: bool = False) -> None:
        from transformers import AutoModelForCausalLM

        self.state = StateDir.open(root, resume=resume)
        self.log = TrajectoryLog(self.state.log_dir)
        self.buffer = GroupBuffer(group_size=2, batch_groups=1)
        self.store = TrajectoryStore(100, 1000, self.buffer.add, self.log)
        self.learner = Learner(AutoModelForCausalLM.from_pretrained(model_dir), LearnerConfig(lr=1e-3), pad_id=0)
        resumed = self.state.resumed
        self.loop = TrainingLoop(self.learner, self.buffer, engine, version=resumed.meta.version if resumed else 0)
        self.recovery = Recovery(self.state, self.log, self.store, self.buffer, model_dir, 2, keep_recent=4)

    def save(self, live: LiveConfiguration, settings: dict[str, Any] = SETTINGS) -> Path:
        return self.recovery.save(self.learner.training_state(), self.loop, settings, live)

    def train_one_batch(self) -> None:
        """What the learner thread does with a batch: a step, and the batch committed and counted."""
        batch = self.buffer.take_batch(timeout=0)
        assert batch is not None
        self.learner.step(build_batch(batch))
        self.loop.live = (self.loop.version + 1, self.learner.steps)
        self.buffer.commit()
        self.store.mark_trained(sum(len(group) for group in batch))

    def close(self) -> None:
        self.log.close()
        self.state.close()


def meta(path: Path) -> CheckpointMeta:
    return CheckpointMeta.from_json((path / "state.json").read_text())


def checkpointed(model_dir: Path, engine: TransformersEngine, root: Path) -> None:
    """A run that checkpointed twice and was stopped: group ``task0`` (lsn 0, 1) trained, ``t2`` (lsn 2)
    buffered at the second checkpoint, ``t3`` (lsn 3) accepted after it; the first log segment compacted."""
    run = Run(model_dir, engine, root)
    try:
        run.store.admit_batch([traj(0), traj(1)], version=0)
        run.store.log_change(Configured({"lr": 0.5}, {"lr": 0.5}, paused=True))
        first = run.save(LiveConfiguration({"lr": 0.5}, paused=True))
        assert meta(first).buffer.lsns() == [0, 1] and (run.log.directory / "00000001.wal").exists()  # still needed
        run.store.admit_batch([traj(2)], version=0)
        run.train_one_batch()
        run.loop.skipped_batches = 3
        second = run.save(LiveConfiguration({"lr": 0.5}, paused=True))
        run.store.admit_batch([traj(3)], version=1)
    finally:
        run.close()
    assert sorted(p.name for p in second.parent.iterdir()) == [first.name, second.name]
    log = root / "log"
    assert not (log / "00000001.wal").exists() and (log / "00000001.ids").exists()  # trained and checkpointed


def test_a_checkpoint_records_the_buffer_the_log_position_and_the_live_configuration(model_dir, engine, tmp_path):
    run = Run(model_dir, engine, tmp_path / "state")
    try:
        run.store.admit_batch([traj(0), traj(1), traj(2)], version=0)  # a complete group and an open one
        run.loop.skipped_batches = 2
        path = run.save(LiveConfiguration({"lr": 0.5, "max_staleness": 3}, paused=True))
        saved = meta(path)
        assert path.name == "step-00000000" and (path / "model" / "config.json").exists()
        assert saved.buffer == run.buffer.snapshot() and saved.buffer.lsns() == [0, 1, 2]
        assert (saved.step, saved.version, saved.next_lsn, saved.trained, saved.skipped_batches) == (0, 0, 3, 0, 2)
        assert saved.settings == {"lr": 0.5, "group_size": 2, "batch_groups": 1}  # training settings only
        assert saved.live == {"lr": 0.5, "max_staleness": 3} and saved.paused
        assert saved.segment == 2 and (run.log.directory / "00000002.wal").exists()  # the log moved on
        assert (run.recovery.last_checkpoint_step, run.recovery.last_checkpoint_path) == (0, path)
    finally:
        run.close()


def test_the_live_configuration_comes_back_from_the_newest_change_whichever_survived(model_dir, engine, tmp_path):
    root = tmp_path / "state"
    fresh = StateDir.open(root)
    log = TrajectoryLog(fresh.log_dir)
    assert restored_configuration(fresh, log) == LiveConfiguration({})
    log.close()
    fresh.close()
    checkpointed(model_dir, engine, root)
    run = Run(model_dir, engine, root, resume=True)  # the change's record was compacted away
    try:
        assert restored_configuration(run.state, run.log) == LiveConfiguration({"lr": 0.5}, paused=True)
        run.store.log_change(Configured({"lr": 0.25}, {"lr": 0.25}, paused=False))
    finally:
        run.close()
    run = Run(model_dir, engine, root, resume=True)
    try:
        assert restored_configuration(run.state, run.log) == LiveConfiguration({"lr": 0.25}, paused=False)
    finally:
        run.close()


def test_resume_puts_back_the_checkpoints_buffer_then_what_was_logged_after_it(model_dir, engine, tmp_path, caplog):
    root = tmp_path / "state"
    checkpointed(model_dir, engine, root)
    run = Run(model_dir, engine, root, resume=True)
    try:
        assert run.state.resumed is not None and run.loop.version == 1
        with caplog.at_level(logging.WARNING, logger="agentjet_server.state.recovery"):
            replayed = run.recovery.replay(run.loop, {**SETTINGS, "lr": 0.25})
        assert replayed == 2 and run.buffer.snapshot().lsns() == [2, 3]  # t2 from the checkpoint, t3 after it
        taken = run.buffer.take_batch(timeout=0)
        assert taken is not None and [t.id for t in taken[0]] == ["t2", "t3"]
        assert run.store.trained == 2 and run.store.accepted == 4 and run.loop.skipped_batches == 3
        assert run.store.admit(traj(0), version=1).status == "duplicate"  # compacted, still known
        assert run.log.scan.trajectories == {}  # the raw bodies are let go once replayed
        assert "resuming with changed training settings: lr 0.5 -> 0.25" in caplog.text
        assert run.recovery.last_checkpoint_step == 1
    finally:
        run.close()


def test_a_log_that_lost_what_the_checkpoint_needs_is_refused(model_dir, engine, tmp_path):
    root = tmp_path / "state"
    checkpointed(model_dir, engine, root)
    (root / "log" / "00000002.wal").unlink()  # held t2, which the checkpoint had buffered
    run = Run(model_dir, engine, root, resume=True)
    try:
        with pytest.raises(StateError, match=r"lacks 1 trajectories the checkpoint needs \(log sequence numbers \[2\]"):
            run.recovery.replay(run.loop, SETTINGS)
    finally:
        run.close()


@pytest.mark.parametrize("algorithm", ["grpo", "ppo", "grpo-lora"])
def test_resume_after_a_crash_equals_training_straight_through(model_dir, trajectories, tmp_path, algorithm):
    """GRPO, PPO with its critic (the value head and its optimizer moments come back exactly too),
    and GRPO training a LoRA adapter (the adapter and its optimizer come back; the base is rebuilt)."""
    half = K * GROUP * GROUPS
    lora = {"lora_rank": 4} if algorithm.endswith("-lora") else {}
    algorithm = algorithm.removesuffix("-lora")

    def start(model_dir: Path, state_dir: Path, **extra: object) -> SwarmRuntime:
        return runtime(model_dir, state_dir, **lora, **extra)

    straight = start(model_dir, tmp_path / "straight", checkpoint_every=0, algorithm=algorithm)
    try:
        assert push(straight, trajectories) == ["accepted"] * len(trajectories)
        # the version moves after the step's weights are live, a moment after the step count, and the
        # batch is counted as trained after both
        wait_for(
            lambda: (
                straight.loop.learner.steps == 2 * K
                and straight.version == 2 * K
                and straight.store.trained == len(trajectories)
            ),
            "2K steps, live and counted",
        )
        expected = weights(straight)
        expected_critic = critic(straight) if algorithm == "ppo" else {}
        assert straight.version == 2 * K
        trained = straight.store.trained
    finally:
        straight.close()

    first = start(model_dir, tmp_path / "crashy", checkpoint_every=K, algorithm=algorithm)
    push(first, trajectories[:half])
    wait_for(lambda: first.loop.saved_step == K, "the checkpoint at step K")
    at_checkpoint = weights(first)
    push(first, trajectories[half:])  # acknowledged (in the log) but not checkpointed
    wait_for(lambda: first.loop.learner.steps >= K + 1, "a step past the checkpoint")
    first.close(checkpoint=False)  # the crash: what the learner did after step K is gone
    assert first.loop.learner.steps > K

    resumed = start(model_dir, tmp_path / "crashy", checkpoint_every=K, resume=True, algorithm=algorithm, start=False)
    try:
        # looked at before the learner starts: the replayed batches would move it on at once
        assert resumed.loop.learner.steps == K and resumed.version == K  # numbering continues
        assert resumed.status().learner.last_checkpoint_step == K
        assert resumed.engine.version == K
        assert resumed.replayed == half  # the checkpoint had nothing buffered; the rest is replayed
        resumed.start()
        wait_for(
            lambda: resumed.loop.learner.steps == 2 * K and resumed.store.trained >= len(trajectories),
            "K more steps, counted",
        )
        time.sleep(0.3)  # nothing more would be trained (nothing left to train twice)
        assert resumed.loop.learner.steps == 2 * K and resumed.buffer.buffered == 0
        diff = max_diff(weights(resumed), expected)
        print(f"resume exactness: max |w_resumed - w_straight| = {diff:.3g} after {2 * K} steps")
        assert diff <= 1e-6
        if algorithm == "ppo":
            critic_diff = max_diff(critic(resumed), expected_critic)
            print(f"resume exactness (critic): {critic_diff:.3g}")
            assert critic_diff <= 1e-6 and float(expected_critic["weight"].abs().max()) > 1e-4
        assert max_diff(at_checkpoint, expected) > 1e-3  # the comparison is not trivially true
        assert resumed.store.trained == trained == len(trajectories)
        if lora:  # the adapter is what trained, and the checkpoint holds it in peft's format
            assert resumed.loop.learner.trainable_parameters < 0.2 * sum(
                p.numel() for p in resumed.loop.learner.model.parameters()
            )
            adapter = sorted((tmp_path / "crashy" / "checkpoints").glob("step-*/adapter/adapter_model.safetensors"))
            assert adapter, "no adapter in the checkpoint"
        # the seen ids survived the crash: a resend is a duplicate, not a second training
        assert push(resumed, trajectories[:3] + trajectories[-3:]) == ["duplicate"] * 6
        assert resumed.store.accepted == len(trajectories)
    finally:
        resumed.close()


def test_buffered_trajectories_come_back_in_order(model_dir, trajectories, tmp_path):
    """Open and complete groups buffered at a checkpoint are put back, in the same order."""
    rt = runtime(model_dir, tmp_path / "state", checkpoint_every=0)
    partial = trajectories[: GROUP + 2]  # one complete group (not a batch yet) and an open one
    push(rt, partial)
    before = rt.buffer.snapshot()
    rt.close()  # no step was taken, so no checkpoint: resume replays the whole log
    again = runtime(model_dir, tmp_path / "state", resume=True)
    try:
        assert again.replayed == len(partial)
        assert again.buffer.snapshot() == before
        push(again, trajectories[GROUP + 2 : GROUP * GROUPS * 2])
        wait_for(lambda: again.loop.learner.steps == 2, "2 steps after the replay")
    finally:
        again.close()
