"""Group advantages (``--advantage``): each episode's reward against a baseline from its group of siblings that
share a task (same prompt). ``episode_advantages`` applies the estimator to a group of trajectories, per agent
where an episode carries ``agent_rewards``; ``learner.batch`` takes them when it builds a batch (a group whose
advantages are all zero carries no signal) and, for ``reinforce_pp``, whitens them over the batch
(``batch_whitened``). PPO's advantages need the critic's values, so they are computed in the step's
no-gradient pass (``learner.prepare``: GAE).

* ``grpo`` — ``(r - mean) / (std + eps)`` (population std): GRPO (Shao et al. 2024).
* ``dr_grpo`` — ``r - mean``: Dr. GRPO (Liu et al. 2025) drops the division by the std.
* ``rloo`` — ``r - mean of the others`` (``n / (n - 1) (r - mean)``): REINFORCE leave-one-out (Ahmadian et al.
  2024).
* ``reinforce_pp`` — ``r - mean``, then whitened over every trained token of the batch: REINFORCE++ with its
  group baseline (Hu 2025; verl's ``reinforce_plus_plus_baseline``).
* ``passk`` — only each group's best episode gets an advantage, ``(r_max - r_second) / (std + eps)``: pass@k
  training (Chen et al. 2025; verl's ``grpo_passk``).

Pure functions, checked against naive loops in ``tests/server/learner/test_advantages.py``.
"""

from __future__ import annotations

from typing import Literal

import torch

from agentjet_client.protocol import Trajectory


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``(r - mean(r)) / (std(r) + eps)`` over one group (population std)."""
    if rewards.ndim != 1 or rewards.numel() == 0:
        raise ValueError("rewards must be a non-empty 1-D tensor of one group's episode rewards")
    centred = rewards - rewards.mean()
    return centred / (rewards.std(unbiased=False) + eps)


Estimator = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "passk"]


def estimated(rewards: torch.Tensor, estimator: Estimator = "grpo", eps: float = 1e-6) -> torch.Tensor:
    """One group's advantages from its episodes' ``rewards`` (1-D), as ``estimator`` says (the module docstring);
    ``reinforce_pp``'s batch whitening comes after, over the whole batch."""
    if rewards.ndim != 1 or rewards.numel() == 0:
        raise ValueError("rewards must be a non-empty 1-D tensor of one group's episode rewards")
    if estimator == "grpo":
        return group_advantages(rewards, eps)
    centred = rewards - rewards.mean()
    n = rewards.numel()
    if estimator in ("dr_grpo", "reinforce_pp"):
        return centred
    if estimator == "rloo":
        return centred * n / (n - 1) if n > 1 else torch.zeros_like(rewards)
    out = torch.zeros_like(rewards)  # passk
    if n > 1:
        top = torch.topk(rewards, 2)
        out[int(top.indices[0])] = (top.values[0] - top.values[1]) / (rewards.std(unbiased=False) + eps)
    return out


def batch_whitened(advantages: list[list[float]]) -> list[list[float]]:
    """Advantages per sequence, each token's, whitened over every token of the batch (REINFORCE++'s batch
    normalisation: token-weighted mean and std)."""
    flat = torch.tensor([a for sequence in advantages for a in sequence], dtype=torch.float64)
    if flat.numel() == 0:
        return advantages
    mean, std = flat.mean(), flat.std(unbiased=False)
    return [[(a - float(mean)) / (float(std) + 1e-8) for a in sequence] for sequence in advantages]


def episode_advantages(complete: list[Trajectory], estimator: Estimator = "grpo") -> list[dict[str, float]]:
    """The advantages of one group's complete episodes, per trajectory: ``{"": the episode's
    advantage, agent: that agent's advantage (from ``agent_rewards``), ...}``."""

    def normalised(values: list[float]) -> list[float]:
        return estimated(torch.tensor(values, dtype=torch.float64), estimator).tolist()

    out: list[dict[str, float]] = [{"": a} for a in normalised([t.reward for t in complete])]
    agents = sorted({name for t in complete for name in (t.agent_rewards or {})})
    for name in agents:
        values = [(t.agent_rewards or {}).get(name, t.reward) for t in complete]
        for per_agent, advantage in zip(out, normalised(values), strict=True):
            per_agent[name] = advantage
    return out
