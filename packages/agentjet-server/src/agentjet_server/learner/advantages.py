"""Both advantage estimators, in one place.

* ``group_advantages`` — GRPO: each episode's reward normalised within its group of siblings that
  share a task (same prompt), so the group mean is the baseline; ``episode_advantages`` applies it to a
  group of trajectories, per agent where an episode carries ``agent_rewards``. ``learner.batch`` takes
  them when it builds a batch (a group whose advantages are all zero carries no signal).
* ``gae`` — PPO: generalised advantage estimation over one timeline's trained tokens, from the critic's
  values and per-token rewards; ``ppo_advantages`` runs it over a step's micro-batches with the critic's
  values and whitens the result (per group of siblings, or over the batch).

Pure functions, checked against naive loops in ``tests/server/learner/test_advantages.py``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import torch

from agentjet_client.protocol import Trajectory
from agentjet_server.learner.distributed import DistContext

# PPO's per-group advantage whitening divides by the group's spread plus this (rewards on a 0-1
# scale), so that small differences between the critic's values are not blown up to unit scale
GROUP_STD_FLOOR = 0.1


class Entries(Protocol):
    """What ``ppo_advantages`` reads and sets on a micro-batch (``learner.packing.MicroBatch``): per
    trained entry its reward, loss weight, group and the critic's value, and each sequence's span."""

    rewards: torch.Tensor
    weights: torch.Tensor
    groups: torch.Tensor
    spans: list[tuple[int, int]]
    old_values: torch.Tensor | None
    advantages: torch.Tensor
    returns: torch.Tensor | None

    @property
    def entries(self) -> int: ...


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``(r - mean(r)) / (std(r) + eps)`` over one group (population std)."""
    if rewards.ndim != 1 or rewards.numel() == 0:
        raise ValueError("rewards must be a non-empty 1-D tensor of one group's episode rewards")
    centred = rewards - rewards.mean()
    return centred / (rewards.std(unbiased=False) + eps)


def gae(rewards: torch.Tensor, values: torch.Tensor, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns of one timeline's trained tokens, in order (1-D tensors).

    ``values[t]`` is the critic's estimate before token t is sampled, ``rewards[t]`` what arrives
    with it (a turn's reward at its last token, the episode's at the timeline's last). The state
    after the last token is terminal (value 0). ``returns = advantages + values``.
    """
    if rewards.shape != values.shape or rewards.ndim != 1:
        raise ValueError("rewards and values must be 1-D tensors of the same length")
    advantages = torch.zeros_like(values)
    running = values.new_zeros(())
    for t in range(values.numel() - 1, -1, -1):
        next_value = values[t + 1] if t + 1 < values.numel() else values.new_zeros(())
        delta = rewards[t] + gamma * next_value - values[t]
        running = delta + gamma * lam * running
        advantages[t] = running
    return advantages, advantages + values


def episode_advantages(complete: list[Trajectory]) -> list[dict[str, float]]:
    """GRPO's advantages of one group's complete episodes, per trajectory: ``{"": the episode's
    advantage, agent: that agent's advantage (from ``agent_rewards``), ...}``."""

    def normalised(values: list[float]) -> list[float]:
        return group_advantages(torch.tensor(values, dtype=torch.float64)).tolist()

    out: list[dict[str, float]] = [{"": a} for a in normalised([t.reward for t in complete])]
    agents = sorted({name for t in complete for name in (t.agent_rewards or {})})
    for name in agents:
        values = [(t.agent_rewards or {}).get(name, t.reward) for t in complete]
        for per_agent, advantage in zip(out, normalised(values), strict=True):
            per_agent[name] = advantage
    return out


def ppo_advantages(micro: Sequence[Entries], gamma: float, lam: float, per_group: bool, ctx: DistContext) -> None:
    """PPO's advantages of each micro-batch (set on it with its returns): GAE over each sequence's
    trained tokens, then whitening, with the same figures on every rank: over the whole batch
    (``per_group`` False: ``--advantage-norm batch``, PPO as usually written), or over each group of
    sibling episodes (``per_group``: ``--advantage-norm group``, the default).

    Per group, ``(A - mean) / (std + GROUP_STD_FLOOR)`` over the group's trained tokens, and a
    group whose episodes all got the same return carries no policy gradient (advantage 0; the
    critic still learns from it), as GRPO's group normalisation does. Whitened over the batch,
    a prompt's advantages scale with the spread of its own rewards, so a rarely solved prompt
    gets a weak push, and a solved prompt's advantages are the critic's residuals, which push
    its tokens in directions no reward asked for: on the demo three of ten prompts collapsed
    onto a wrong answer and PPO stalled at 0.6-0.7; per group it reaches 0.87-0.99
    (docs/benchmarks.md)."""
    for m in micro:
        assert m.old_values is not None
        advantages = torch.zeros_like(m.old_values)
        returns = torch.zeros_like(m.old_values)
        for start, end in m.spans:
            a, r = gae(m.rewards[start:end], m.old_values[start:end], gamma, lam)
            advantages[start:end], returns[start:end] = a, r
        m.advantages, m.returns = advantages, returns
    size = max((int(m.groups.max()) + 1 for m in micro if m.entries), default=1) if per_group else 1
    if ctx.enabled and per_group:
        import torch.distributed as dist

        largest = torch.tensor([size], dtype=torch.int64)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        size = int(largest.item())
    sums = torch.zeros(3, size, dtype=torch.float64)  # weighted sums of A, of A^2, of the weights
    lowest = torch.full((size,), math.inf, dtype=torch.float64)  # each group's lowest and highest return
    highest = torch.full((size,), -math.inf, dtype=torch.float64)
    for m in micro:
        w, a = m.weights.double().cpu(), m.advantages.double().cpu()
        index = m.groups.cpu() if per_group else torch.zeros_like(m.groups.cpu())
        for row, values in enumerate((w * a, w * a * a, w)):
            sums[row].index_add_(0, index, values)
        rewards = m.rewards.double().cpu()
        for start, end in m.spans:
            if end > start:
                g, total_return = int(index[start]), rewards[start:end].sum()
                lowest[g] = torch.minimum(lowest[g], total_return)
                highest[g] = torch.maximum(highest[g], total_return)
    if ctx.enabled:
        import torch.distributed as dist

        dist.all_reduce(sums)
        dist.all_reduce(lowest, op=dist.ReduceOp.MIN)
        dist.all_reduce(highest, op=dist.ReduceOp.MAX)
    total = sums[2].clamp(min=1e-12)
    mean = sums[0] / total
    std = (sums[1] / total - mean * mean).clamp(min=0.0).sqrt()
    scale = std + (GROUP_STD_FLOOR if per_group else 1e-8)
    signal = (highest - lowest > 1e-9) | torch.tensor(not per_group)  # per group: flat groups carry none
    for m in micro:
        index = m.groups.cpu() if per_group else torch.zeros_like(m.groups.cpu())
        whitened = (m.advantages - mean[index].to(m.advantages)) / scale[index].to(m.advantages)
        m.advantages = torch.where(signal[index].to(m.advantages.device), whitened, torch.zeros_like(whitened))
