"""The no-gradient pass of a step: what the objective needs that the batch does not carry, computed with the
weights about to be updated, before any of them changes.

* ``prepare`` (reinforcement learning): each micro-batch's *proximal* log-probs (the decoupled objective; the
  sampled log-probs are reused where the current version sampled them), the frozen reference model's
  log-probs (the KL penalty), the critic's values, then GAE and advantage whitening (PPO: ``gae``,
  ``ppo_advantages``), and with a teacher each sampled token's distillation advantage
  (``teacher_advantages``).
* ``weigh_pairs`` (DPO): each sequence's summed log-prob (``sequence_sums``) turned into its pair weight.

Every rank runs the same passes (a rank without a micro-batch left runs the learner's one-token idle pass,
since FSDP gathers weights collectively), and the figures that need the whole batch are reduced over ranks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from agentjet_server.learner.config import LearnerConfig
from agentjet_server.learner.distributed import DistContext
from agentjet_server.learner.objective import corrects_rollout, dpo_weights
from agentjet_server.learner.packing import MicroBatch, MiniBatch
from agentjet_server.learner.policy import PolicyModel
from agentjet_server.learner.teacher import RemoteTeacher

# PPO's per-group advantage whitening divides by the group's spread plus this (rewards on a 0-1
# scale), so that small differences between the critic's values are not blown up to unit scale
GROUP_STD_FLOOR = 0.1


class Models(Protocol):
    """What the pass reads of the learner (``trainer.Learner``)."""

    config: LearnerConfig
    policy: PolicyModel
    reference: PolicyModel | None
    teacher: PolicyModel | None  # a local teacher
    remote_teacher: RemoteTeacher | None  # one behind a URL, which scored the batch's sequences before the step
    ctx: DistContext
    idle: MicroBatch  # the stand-in for a rank with no micro-batch left


def prepare(models: Models, plan: list[MiniBatch], version: int | None, tokens: float = 1.0) -> dict[str, Any]:
    """Fill every micro-batch's proximal and reference log-probs and, for PPO, its values, GAE returns and
    whitened advantages; with a teacher (``distill_coef`` above 0), add its per-token advantage. Its figures:
    under "shares", this rank's shares (of the batch's ``tokens`` trained tokens) of the means that every
    rank's shares add up to."""
    config = models.config
    micro = [m for mini in plan for m in mini.micro]
    real = [m for m in micro if m is not None]
    all_current = version is not None and all(bool((m.versions == version).all()) for m in real)
    # the same on every rank: each holds the whole batch's versions only for its share, so agree
    need_prox = config.off_policy == "decoupled" and not corrects_rollout(config)
    need_prox = need_prox and not all_ranks(models.ctx, all_current)
    # rollout correction needs pi_old of every token; the update's first forward gives it for the first
    # mini-batch (before any optimizer step), a later mini-batch needs it from here
    need_trainer = corrects_rollout(config) and len(plan) > 1
    if need_prox or need_trainer or config.algorithm == "ppo":
        _policy_pass(models, micro, version if need_prox else None, need_prox)
    for m in real:
        if m.proximal_logprobs is None:
            m.proximal_logprobs = m.old_logprobs
    if models.reference is not None and config.kl_coef > 0:
        with torch.no_grad():
            for m in real:
                m.reference_logprobs = models.reference.run(m)[0]
    if config.algorithm == "ppo":
        ppo_advantages(real, config.gamma, config.lam, config.advantage_norm == "group", models.ctx)
    if config.distill_coef <= 0:
        return {}
    if models.teacher is None and models.remote_teacher is None:
        return {}
    gaps = teacher_gaps(models.teacher, real)
    gap_sum = teacher_advantages(models.ctx, real, gaps, config.distill_coef if config.distill_loss == "sampled" else 0)
    return {"shares": {"teacher_kl": -gap_sum / max(tokens, 1.0)}}


def _policy_pass(models: Models, micro: list[MicroBatch | None], version: int | None, proximal: bool) -> None:
    """One forward pass of the policy over every micro-batch: the trainer's log-probs, the proximal ones
    (``proximal``: the tokens ``version`` sampled keep their sampled log-probs) and, with a critic, the values."""
    with torch.no_grad():
        for m in micro:
            logprobs, _entropy, values = models.policy.run(m if m is not None else models.idle)
            if m is None:
                continue
            m.trainer_logprobs = logprobs
            if proximal:
                current = (m.versions == version) if version is not None else torch.zeros_like(m.weights).bool()
                m.proximal_logprobs = torch.where(current, m.old_logprobs, logprobs)
            if values is not None:
                m.old_values = values.float()


def teacher_gaps(teacher: PolicyModel | None, real: list[MicroBatch]) -> list[torch.Tensor]:
    """Per micro-batch, ``log pi_teacher - log pi_behaviour`` at each sampled token (the negative of the
    per-token reverse KL): from a local ``teacher``, else from the log-probs a remote one gave the batch's
    sequences."""
    gaps = []
    with torch.no_grad():
        for m in real:
            if teacher is not None:
                scored = teacher.run(m)[0].float()
            elif m.teacher_logprobs is None or bool(torch.isnan(m.teacher_logprobs).any()):
                raise ValueError("a token of this batch has no teacher log-prob: the remote teacher did not score it")
            else:
                scored = m.teacher_logprobs
            gaps.append(scored - m.old_logprobs)
    return gaps


def teacher_advantages(ctx: DistContext, real: list[MicroBatch], gaps: list[torch.Tensor], coef: float) -> float:
    """Add ``coef`` times each token's gap minus its baseline to its advantage; this rank's sum of the gaps.

    The baseline of a token is the mean gap of its group's tokens at the same depth (the siblings' choices
    at that step, as GRPO's group mean is the rewards'): the advantages at each step then sum to zero, so
    the tokens no sibling sampled are not all pushed up (or down) together, which AdamW, scaling each
    weight's step to the same size whatever its gradient, would otherwise do to the whole vocabulary."""
    keys = [m.groups.cpu() * (1 << 32) + m.position_ids[0, m.entry_nodes].cpu() for m in real]
    sums: dict[int, list[float]] = {}
    for key, gap, m in zip(keys, gaps, real, strict=True):
        for k, g, w in zip(key.tolist(), gap.tolist(), m.weights.tolist(), strict=True):
            entry = sums.setdefault(k, [0.0, 0.0])
            entry[0] += g * w
            entry[1] += w
    gap_sum = sum(v[0] for v in sums.values())  # this rank's share, before the ranks' sums are merged
    if ctx.enabled:
        import torch.distributed as dist

        every: list[dict[int, list[float]] | None] = [None] * ctx.world_size
        dist.all_gather_object(every, sums)
        sums = {}
        for gathered in every:
            for k, (g, w) in (gathered or {}).items():
                entry = sums.setdefault(k, [0.0, 0.0])
                entry[0] += g
                entry[1] += w
    if coef:  # the "full" distillation loss is a term of the objective instead
        for key, gap, m in zip(keys, gaps, real, strict=True):
            baseline = torch.tensor([sums[k][0] / max(sums[k][1], 1e-12) for k in key.tolist()], dtype=gap.dtype)
            m.advantages = m.advantages + coef * (gap - baseline.to(gap.device))
    return gap_sum


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


def ppo_advantages(micro: Sequence[MicroBatch], gamma: float, lam: float, per_group: bool, ctx: DistContext) -> None:
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
    mean, scale, signal = _whitening(micro, size, per_group, ctx)
    for m in micro:
        index = m.groups.cpu() if per_group else torch.zeros_like(m.groups.cpu())
        whitened = (m.advantages - mean[index].to(m.advantages)) / scale[index].to(m.advantages)
        m.advantages = torch.where(signal[index].to(m.advantages.device), whitened, torch.zeros_like(whitened))


def _whitening(
    micro: Sequence[MicroBatch], size: int, per_group: bool, ctx: DistContext
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per group (or for the batch, ``size`` 1): the advantages' weighted mean, the scale to divide by, and
    whether the group's returns differ (per group, a flat group carries no policy gradient)."""
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
    signal = (highest - lowest > 1e-9) | torch.tensor(not per_group)
    return mean, scale, signal


def sequence_sums(models: Models, plan: list[MiniBatch], count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each of a batch's ``count`` sequences (``Sequence.group`` numbers them), the weighted sum of its
    trained tokens' log-probs under the learner's weights, and of the batch's own ``old_logprobs`` of them,
    summed over every rank's share (float64, on the CPU)."""
    sums = torch.zeros(2, count, dtype=torch.float64)
    with torch.no_grad():
        for m in [m for mini in plan for m in mini.micro]:
            logprobs = models.policy.run(m if m is not None else models.idle)[0]
            if m is None:
                continue
            index = m.groups.cpu()
            sums[0].index_add_(0, index, (logprobs.float() * m.weights).double().cpu())
            sums[1].index_add_(0, index, (m.old_logprobs * m.weights).double().cpu())
    if models.ctx.enabled:
        import torch.distributed as dist

        dist.all_reduce(sums)
    return sums[0], sums[1]


def weigh_pairs(models: Models, plan: list[MiniBatch], count: int, beta: float) -> dict[str, float]:
    """(DPO) Each entry's advantage becomes its sequence's pair weight (``objective.dpo_weights``: the
    batch's ``old_logprobs`` carry each of its ``count`` sequences' reference log-prob), and the step's
    figures."""
    logps, reference = sequence_sums(models, plan, count)
    weights, figures = dpo_weights(logps, reference, beta)
    for m in [m for mini in plan for m in mini.micro if m is not None]:
        m.advantages = weights.to(device=m.advantages.device, dtype=m.advantages.dtype)[m.groups]
    return figures


def all_ranks(ctx: DistContext, flag: bool) -> bool:
    """``flag`` on every rank (the minimum over ranks)."""
    if not ctx.enabled:
        return flag
    import torch.distributed as dist

    value = torch.tensor([1 if flag else 0], dtype=torch.int64)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())
