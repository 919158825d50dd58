"""Pure loss functions of the learner: no state, no I/O, tensors in and tensors out.

* ``group_advantages`` — GRPO: each episode's reward normalised within its group of siblings
  that share a task (same prompt), so the group mean is the baseline.
* ``clipped_policy_loss`` — the PPO-style clipped surrogate against the *behaviour*
  log-probabilities the engine recorded when it sampled. The ratio ``pi_theta / pi_behaviour``
  is the importance-sampling correction for turns sampled by an older policy version; clipping
  bounds how far a stale turn can push the update. Token-mean over all trained tokens.
"""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``(r - mean(r)) / (std(r) + eps)`` over one group (population std)."""
    if rewards.ndim != 1 or rewards.numel() == 0:
        raise ValueError("rewards must be a non-empty 1-D tensor of one group's episode rewards")
    centred = rewards - rewards.mean()
    return centred / (rewards.std(unbiased=False) + eps)


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    normaliser: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate, summed over masked tokens and divided by ``normaliser``.

    ``normaliser`` defaults to the number of masked tokens; pass the whole batch's token count
    when the batch is split into micro-batches so that gradients add up to the token mean.
    """
    mask = mask.to(logprobs.dtype)
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    denominator = normaliser if normaliser is not None else float(mask.sum().clamp(min=1.0))
    loss = (per_token * mask).sum() / denominator
    with torch.no_grad():
        count = float(mask.sum().clamp(min=1.0))
        stats = {
            "clip_fraction": float(((unclipped != clipped).to(mask.dtype) * mask).sum() / count),
            "ratio_mean": float((ratio * mask).sum() / count),
            "approx_kl": float((((ratio - 1) - (logprobs - old_logprobs)) * mask).sum() / count),
        }
    return loss, stats
