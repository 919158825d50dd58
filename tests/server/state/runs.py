"""Helpers of the state tests: the real runtime over a state dir (tiny model, real learner thread), groups of
trajectories to push to it, and its weights to compare."""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch

from agentjet_client.protocol import Trajectory, TrajectoryBatch, Turn
from agentjet_server.engine.base import EngineOptions
from agentjet_server.engine.hf import TransformersEngine
from agentjet_server.runtime import SwarmRuntime, create_runtime
from agentjet_server.settings import ServerSettings

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


def runtime(model_dir: Path, state_dir: Path, start: bool = True, **extra: object) -> SwarmRuntime:
    """A runtime over the embedded model (``start`` False: built, its learner not started yet)."""
    options: dict[str, object] = {"group_size": GROUP, "batch_groups": GROUPS, "max_staleness": 1000, "lr": 1e-2}
    settings = ServerSettings(state_dir=state_dir, **{**options, **extra})  # type: ignore[arg-type]
    engine = TransformersEngine(model_dir, EngineOptions(model_name="agentjet-tiny"))
    return create_runtime(engine, settings, str(model_dir), start=start)


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
