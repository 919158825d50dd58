"""Checkpoints and resume on the real runtime (tiny model, real learner thread, real state dir).

The exactness test: K steps, checkpoint, a "crash" a little later (the learner is stopped with no
final checkpoint, so steps after K are lost), resume, K more; versus 2K steps straight on the same
trajectories. The weights must agree within 1e-6 (CPU, fp32), so resume neither skips nor repeats
a trajectory, and restores the optimizer exactly.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
import torch

from agentjet_client.protocol import Trajectory, TrajectoryBatch, Turn
from agentjet_server.engine.base import EngineOptions
from agentjet_server.engine.hf import TransformersEngine
from agentjet_server.errors import StateError
from agentjet_server.ingest.wal import Rejected, TrajectoryLog
from agentjet_server.runtime import SwarmRuntime
from agentjet_server.settings import ServerSettings
from agentjet_server.state.checkpoint import StateDir

K = 3
GROUP, GROUPS = 4, 2  # trajectories per group, groups per step


def make_trajectories(vocab: int, steps: int, seed: int = 0) -> list[Trajectory]:
    """Groups of varied rewards over random token sequences (the learner needs only valid ids)."""
    rng = random.Random(seed)
    out = []
    for g in range(steps * GROUPS):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(4, 12))]
        for i in range(GROUP):
            completion = [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
            turn = Turn(
                policy_version=0,
                prompt_token_ids=prompt,
                completion_token_ids=completion,
                completion_logprobs=[-rng.uniform(3.0, 7.0) for _ in completion],
                finish_reason="stop",
            )
            out.append(
                Trajectory(id=f"g{g}-{i}", task_id=f"task-{g}", turns=[turn], reward=float(i % 2 + rng.random()))
            )
    return out


def runtime(model_dir: Path, state_dir: Path, **extra: object) -> SwarmRuntime:
    options: dict[str, object] = {"group_size": GROUP, "batch_groups": GROUPS, "max_staleness": 1000, "lr": 1e-2}
    settings = ServerSettings(state_dir=state_dir, **{**options, **extra})  # type: ignore[arg-type]
    engine = TransformersEngine(model_dir, EngineOptions(model_name="agentjet-tiny"))
    return SwarmRuntime.create(engine, settings, str(model_dir))


def critic(rt: SwarmRuntime) -> dict[str, torch.Tensor]:
    head = rt.loop.learner.policy.value_head
    assert head is not None
    return {k: v.detach().clone() for k, v in head.state_dict().items()}


def push(rt: SwarmRuntime, trajectories: list[Trajectory], chunk: int = 5) -> list[str]:
    statuses = []
    for i in range(0, len(trajectories), chunk):
        result = rt.ingest(TrajectoryBatch(trajectories=trajectories[i : i + chunk]))
        statuses += [r.status for r in result.results]
    return statuses


def wait_for(condition, what: str, limit: float = 120.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def weights(rt: SwarmRuntime) -> dict[str, torch.Tensor]:
    return rt.loop.learner.full_state_dict()


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture(scope="module")
def trajectories(model_dir: Path) -> list[Trajectory]:
    import json

    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    return make_trajectories(vocab, 2 * K)


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
        # the version moves after the step's weights are live, a moment after the step count
        wait_for(lambda: straight.loop.learner.steps == 2 * K and straight.version == 2 * K, "2K steps, live")
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

    resumed = start(model_dir, tmp_path / "crashy", checkpoint_every=K, resume=True, algorithm=algorithm)
    try:
        assert resumed.loop.learner.steps == K and resumed.version == K  # numbering continues
        assert resumed.status().learner.last_checkpoint_step == K
        assert resumed.engine.version == K
        assert resumed.replayed == half  # the checkpoint had nothing buffered; the rest is replayed
        wait_for(lambda: resumed.loop.learner.steps == 2 * K, "K more steps")
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


def test_checkpoint_is_a_transformers_model_and_shutdown_saves_one(model_dir, trajectories, tmp_path):
    from transformers import AutoModelForCausalLM

    rt = runtime(model_dir, tmp_path / "state", checkpoint_every=0)
    push(rt, trajectories[: 2 * GROUP * GROUPS])
    wait_for(lambda: rt.loop.learner.steps == 2, "2 steps")
    live = weights(rt)
    rt.close()  # a SIGTERM ends here too: the last checkpoint is written on the way out
    state = StateDir.open(tmp_path / "state", resume=True)
    try:
        checkpoint = state.latest()
        assert checkpoint is not None and checkpoint.meta.step == 2 and checkpoint.meta.version == 2
        assert checkpoint.meta.buffer.lsns() == [] and checkpoint.meta.next_lsn == 2 * GROUP * GROUPS
        model = AutoModelForCausalLM.from_pretrained(checkpoint.model_dir, dtype=torch.float32)
        loaded = model.state_dict()
        assert max(float((loaded[k] - live[k]).abs().max()) for k in live) == 0.0
        assert (checkpoint.model_dir / "tokenizer.json").exists()
    finally:
        state.close()


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


def test_state_dir_start_policy(model_dir, tmp_path):
    root = tmp_path / "state"
    StateDir.open(root).close()  # empty: fresh
    (root / "log").mkdir(exist_ok=True)
    (root / "log" / "00000001.wal").write_bytes(b"")
    StateDir.open(root).close()  # a server stopped before anything was pushed: nothing to resume
    log = TrajectoryLog(root / "log")
    log.append([Rejected("t0", "stale")])
    log.close()
    with pytest.raises(StateError, match="pass --resume to continue it, --fresh to discard it"):
        StateDir.open(root)
    with pytest.raises(StateError, match="contradict"):
        StateDir.open(root, resume=True, fresh=True)
    held = StateDir.open(root, resume=True)
    try:
        with pytest.raises(StateError, match=r"in use by agentjet-server pid \d+"):
            StateDir.open(root, resume=True)
    finally:
        held.close()
    StateDir.open(root, fresh=True).close()
    assert not (root / "log").exists()
    StateDir.open(root).close()  # discarded: a plain start works again


def test_tied_head_model_round_trips_through_a_checkpoint(model_dir, trajectories, tmp_path):
    """HF drops a tied head from saved weights; loading fills it from the embedding, and the
    optimizer's moments come back for every parameter."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from agentjet_server.batching.buffer import BufferSnapshot
    from agentjet_server.learner.batch import build_batch
    from agentjet_server.learner.trainer import Learner, LearnerConfig
    from agentjet_server.state.checkpoint import CheckpointMeta

    config = AutoConfig.from_pretrained(model_dir)
    config.tie_word_embeddings = True

    def learner() -> Learner:
        torch.manual_seed(5)
        return Learner(AutoModelForCausalLM.from_config(config), LearnerConfig(lr=1e-2), pad_id=0)

    groups = [trajectories[i : i + GROUP] for i in range(0, 2 * GROUP, GROUP)]
    trained = learner()
    trained.step(build_batch(groups))
    state = StateDir.open(tmp_path / "state")
    try:
        meta = CheckpointMeta(
            step=1, version=1, next_lsn=0, buffer=BufferSnapshot(), trained=0, skipped_batches=0, segment=2
        )
        state.write(meta, trained.training_state(), trained.model, model_dir, keep=2)
        checkpoint = state.latest()
        assert checkpoint is not None
        restored = learner()
        restored.load_training_state(checkpoint.trainer_state())
    finally:
        state.close()
    assert restored.steps == 1
    head = restored.model.get_output_embeddings().weight
    assert head is restored.model.get_input_embeddings().weight  # still tied, not two copies
    for (name, a), b in zip(trained.model.named_parameters(), restored.model.parameters(), strict=True):
        assert torch.equal(a, b), name
    for a, b in zip(trained.optimizer.state.values(), restored.optimizer.state.values(), strict=True):
        assert all(torch.equal(a[k], b[k]) for k in ("exp_avg", "exp_avg_sq", "step"))
    trained.step(build_batch(groups))
    restored.step(build_batch(groups))
    assert all(torch.equal(a, b) for a, b in zip(trained.model.parameters(), restored.model.parameters(), strict=True))
