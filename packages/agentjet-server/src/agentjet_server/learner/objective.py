"""The learner's objective: one micro-batch's loss (``objective``) and the pure loss functions it is made
of (tensors in, tensors out). The advantages they weigh tokens by come from the batch (``learner.batch``:
GRPO's group advantages) or from the no-gradient pass before the update (``learner.prepare``: PPO's GAE,
the teacher's per-token advantage, DPO's sequence weights).

Policy losses (``--policy-loss``, per trained token: ``*_terms``; docs/objectives.md has each formula and its
reference): ``ppo_terms`` (the clipped ratio), ``gspo_terms`` (one length-normalised ratio per sequence),
``cispo_terms`` (a capped stop-gradient weight on log pi), ``sapo_terms`` (a soft gate), ``importance_terms``
and ``dro_terms`` (Tinker's forms). ``policy_terms`` picks one and applies ``--off-policy``; ``aggregate``
turns the tokens' losses into the mini-batch's share (``--loss-aggregation``).

The off-policy modes (``--off-policy``, in ``policy_terms``)
* ``none`` — the loss against the *behaviour* log-probs the engine recorded when it sampled. At high
  staleness the behaviour policy is many versions old, and one clip around it both corrects for staleness
  and bounds the update: the AReaL paper's "naive PPO", which degrades as staleness grows.
* ``decoupled`` — AReaL's decoupled objective: the loss (PPO's clip, say) against a *proximal* policy (the
  weights about to be updated), and the staleness corrected separately by the importance weight
  ``pi_prox / pi_behaviour``, truncated at a cap (``importance_weight``; per sequence with
  ``--sequence-is``).
* ``tis`` — truncated importance sampling on the plain policy gradient (``tis_terms``): each token's
  gradient ``A * grad log pi`` weighted by ``min(pi / pi_behaviour, cap)``, no clip.

Rollout correction (``--token-mask``, ``--sequence-mask``: ``rollout_masks``; ``--mismatch-kl-coef``) and the
mismatch figures of a step (``mismatch_figures``) compare the trainer's log-probs (pi_old) with the sampler's.

Preference
* ``dpo_weights`` — DPO's loss on (chosen, rejected) pairs, ``-log sigmoid(beta * margin)`` with the
  margin ``(log pi(chosen) - log ref(chosen)) - (log pi(rejected) - log ref(rejected))`` over whole
  completions, turned into one weight per sequence: the loss's gradient is
  ``-beta * sigmoid(-beta * margin) * (grad log pi(chosen) - grad log pi(rejected))``, so a per-token
  objective ``-weight * log pi(token)`` with those weights (computed with the weights about to be
  updated) has exactly the pair loss's gradient, and the sequences of a pair can be packed, split
  between micro-batches and sharded like any others.

Regularisers
* ``k3_kl`` — Schulman's k3 estimator of KL(pi || pi_ref) per token, ``exp(d) - d - 1`` with
  ``d = log pi_ref - log pi``: non-negative, unbiased, low variance.
* ``clipped_value_loss`` — the critic's squared error to its returns, clipped around the values
  it had when the batch was built (PPO's value clip).
"""

from __future__ import annotations

import math

import torch

from agentjet_server.learner.batch import Mode
from agentjet_server.learner.config import LearnerConfig
from agentjet_server.learner.distributed import DistContext
from agentjet_server.learner.packing import MicroBatch
from agentjet_server.learner.policy import PolicyModel, chosen_and_entropy


def objective(
    config: LearnerConfig,
    policy: PolicyModel,
    part: MicroBatch,
    tokens: float,
    mode: Mode = "rl",
    teacher: PolicyModel | None = None,
    sequences: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """This micro-batch's share of its mini-batch's loss and its figures (means over its entries): the
    policy loss (``--policy-loss``, against the proximal or the behaviour log-probs as ``--off-policy``
    says) with the KL penalty, aggregated as ``--loss-aggregation`` says over the mini-batch's ``tokens``
    trained tokens or ``sequences`` sequences (this micro-batch's own when None), plus the value and entropy
    terms (token means); for ``mode`` "sft" the negative log-likelihood of the trained tokens alone. With
    ``teacher`` (``distill_loss`` "full"), plus the exact KL(student || teacher) over the vocabulary at each
    trained position."""
    distribution, values = policy.distribution(part)
    logprobs, entropy = chosen_and_entropy(distribution, part.targets)
    if part.fresh and part.trainer_logprobs is None:  # no optimizer step yet: these are pi_old
        part.trainer_logprobs = logprobs.detach()
    weights = part.weights
    if mode == "dpo":  # each sequence's weight (``weigh_pairs``) times its log-prob: the pair loss's gradient
        return -(logprobs.float() * part.advantages * weights).sum(), {"entropy": float(entropy.detach().mean())}
    if mode == "sft":
        nll = -(logprobs.float() * weights).sum()
        with torch.no_grad():
            figures = {"nll": float(nll.detach()) / max(float(weights.sum()), 1.0), "entropy": float(entropy.mean())}
        return nll / tokens, figures
    per_token, stats = policy_terms(config, logprobs, part)
    if config.kl_coef > 0:  # aggregated with the policy term, as its per-token penalty
        assert part.reference_logprobs is not None
        kl = k3_kl(logprobs, part.reference_logprobs)
        per_token = per_token + config.kl_coef * kl
        stats["kl_reference"] = float(kl.detach().mean())
    if config.mismatch_kl_coef > 0:  # towards the sampler: (log pi - log mu)^2 / 2
        drift = logprobs - part.old_logprobs
        per_token = per_token + config.mismatch_kl_coef * 0.5 * drift * drift
    loss = aggregate(per_token, weights, part.spans, config, tokens, sequences or float(len(part.spans)))
    if values is not None:
        assert part.old_values is not None and part.returns is not None
        value_loss, value_stats = clipped_value_loss(
            values, part.old_values, part.returns, weights, config.value_clip, normaliser=tokens
        )
        loss = loss + config.vf_coef * value_loss
        stats.update(value_stats)
    if config.entropy_coef:
        loss = loss - config.entropy_coef * (entropy * weights).sum() / tokens
    if teacher is not None:
        with torch.no_grad():
            taught = teacher.distribution(part)[0]
        exact = (distribution.exp() * (distribution - taught)).sum(-1)  # [E] KL(student || teacher) per position
        loss = loss + config.distill_coef * (exact * weights).sum() / tokens
        stats["teacher_kl_exact"] = float(exact.detach().mean())
    with torch.no_grad():
        stats["entropy"] = float(entropy.mean())
    return loss, stats


def corrects_rollout(config: LearnerConfig) -> bool:
    """Whether any rollout correction is on (so every token needs the trainer's pi_old)."""
    return bool(config.token_mask or config.sequence_mask or config.sequence_is or config.mismatch_kl_coef)


def policy_terms(
    config: LearnerConfig, logprobs: torch.Tensor, part: MicroBatch
) -> tuple[torch.Tensor, dict[str, float]]:
    """Each entry's policy loss ``[E]`` (unweighted, not aggregated) and the figures: the loss of
    ``--policy-loss`` against the proximal log-probs (``--off-policy decoupled``, then weighted by the
    truncated ``pi_prox / pi_behaviour``, per token or per sequence) or the behaviour ones (``none``); ``tis``
    is a loss of its own. With rollout correction, the proximal log-probs are the trainer's own (pi_old) and
    the masks leave out the tokens and sequences where the trainer and the sampler disagree."""
    behaviour = part.old_logprobs
    if corrects_rollout(config) and part.trainer_logprobs is None:
        raise RuntimeError("rollout correction needs pi_old of every token: prepare computes it for later mini-batches")
    if config.off_policy == "tis":
        per_token, stats = tis_terms(logprobs, behaviour, part.advantages, part.weights, config.is_cap)
    else:
        old: torch.Tensor | None = behaviour
        if config.off_policy == "decoupled":
            old = part.trainer_logprobs if corrects_rollout(config) else part.proximal_logprobs
        assert old is not None
        per_token, stats = _named_loss(config, logprobs, old, part)
        if config.off_policy == "decoupled":
            spans = part.spans if config.sequence_is else None
            weight, weight_stats = importance_weight(old - behaviour, config.is_cap, part.weights, spans)
            stats.update(weight_stats, behaviour_kl=weight_stats.pop("kl"))
            per_token = weight * per_token
    if config.token_mask or config.sequence_mask:
        assert part.trainer_logprobs is not None
        keep, mask_stats = rollout_masks(part.trainer_logprobs - behaviour, part.weights, part.spans, config)
        per_token = per_token * keep
        stats.update(mask_stats)
    return per_token, stats


def _named_loss(
    config: LearnerConfig, logprobs: torch.Tensor, old: torch.Tensor, part: MicroBatch
) -> tuple[torch.Tensor, dict[str, float]]:
    """The per-token loss that ``--policy-loss`` names, against ``old``."""
    advantages, weights, name = part.advantages, part.weights, config.policy_loss
    if name == "ppo":
        return ppo_terms(logprobs, old, advantages, weights, config.clip_low, config.clip_high)
    if name == "gspo":
        return gspo_terms(logprobs, old, advantages, weights, part.spans, config.clip_low, config.clip_high)
    if name == "cispo":
        return cispo_terms(logprobs, old, advantages, weights, config.cispo_cap)
    if name == "sapo":
        return sapo_terms(logprobs, old, advantages, weights, config.sapo_tau_pos, config.sapo_tau_neg)
    if name == "importance_sampling":
        return importance_terms(logprobs, old, advantages, weights)
    return dro_terms(logprobs, old, advantages, weights, config.dro_beta)


def importance_weight(
    log_ratio: torch.Tensor, cap: float, weights: torch.Tensor, spans: list[tuple[int, int]] | None = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """The truncated importance weight of each entry (no gradient) from ``log_ratio`` = log pi_prox - log mu:
    ``min(pi_prox / mu, cap)`` per token, or with ``spans`` per sequence, ``min(prod_t pi_prox / mu, cap)``
    at each of its tokens (taken in log space, so a long sequence's product never overflows); and its
    figures (the weight, the share truncated, the k3 KL estimate "kl")."""
    with torch.no_grad():
        log_ratio = log_ratio.detach()
        if spans is not None:
            sums, _, index = _per_sequence(spans, log_ratio)
            raw = torch.exp(torch.clamp(sums, max=math.log(cap) + 1.0))[index]
        else:
            raw = torch.exp(log_ratio)
        stats = _weight_stats(raw, cap, log_ratio, weights)
        return torch.clamp(raw, max=cap), stats


def rollout_masks(
    log_ratio: torch.Tensor, weights: torch.Tensor, spans: list[tuple[int, int]], config: LearnerConfig
) -> tuple[torch.Tensor, dict[str, float]]:
    """Which entries train (1) and which rollout correction leaves out (0), from ``log_ratio`` = log pi_old -
    log mu: ``--token-mask`` (IcePop) a token whose ratio is outside its bounds, ``--sequence-mask`` every token
    of a sequence whose geometric-mean ratio ``exp(mean_t log(pi_old / mu))`` is; and the share of trained tokens
    each left out."""
    with torch.no_grad():
        log_ratio = log_ratio.detach().float()
        present = (weights != 0).to(log_ratio.dtype)
        count = _count(weights)
        keep = torch.ones_like(log_ratio)
        stats: dict[str, float] = {}
        if config.token_mask:
            low, high = config.token_mask
            inside = (log_ratio >= _log(low)) & (log_ratio <= math.log(high))
            keep = keep * inside.to(keep.dtype)
            stats["token_masked"] = float(((~inside).to(keep.dtype) * present).sum() / count)
        if config.sequence_mask:
            low, high = config.sequence_mask
            sums, lengths, index = _per_sequence(spans, log_ratio)
            mean = (sums / lengths)[index]
            inside = (mean >= _log(low)) & (mean <= math.log(high))
            keep = keep * inside.to(keep.dtype)
            stats["sequence_masked"] = float(((~inside).to(keep.dtype) * present).sum() / count)
        return keep, stats


def _log(bound: float) -> float:
    return math.log(bound) if bound > 0 else -math.inf


def mismatch_figures(micro: list[MicroBatch], ctx: DistContext) -> dict[str, float]:
    """How far the sampler's log-probs (mu) are from the trainer's at the weights the step started from
    (pi_old), over every trained token that has both (every token with rollout correction on or a single
    mini-batch; else the first mini-batch's): quantiles of the token ratio pi_old / mu and of each sequence's
    geometric-mean ratio, the k3 estimate of KL(mu || pi_old), and the correlation of the two log-probs.
    The same figures on every rank (gathered); none where no token has both."""
    tokens: list[torch.Tensor] = []
    trainer: list[torch.Tensor] = []
    behaviour: list[torch.Tensor] = []
    sequences: list[torch.Tensor] = []
    for m in micro:
        if m.trainer_logprobs is None:
            continue
        present = (m.weights != 0).cpu()
        pi_old, mu = m.trainer_logprobs.detach().float().cpu(), m.old_logprobs.float().cpu()
        ratio = pi_old - mu
        tokens.append(ratio[present])
        trainer.append(pi_old[present])
        behaviour.append(mu[present])
        if m.spans:
            sums, lengths, _ = _per_sequence(m.spans, ratio)
            sequences.append(sums / lengths)
    parts = [torch.cat(x) if x else torch.zeros(0) for x in (tokens, trainer, behaviour, sequences)]
    if ctx.enabled:
        import torch.distributed as dist

        every: list[list[torch.Tensor] | None] = [None] * ctx.world_size
        dist.all_gather_object(every, parts)
        parts = [torch.cat([g[i] for g in every if g is not None]) for i in range(4)]
    log_ratio, pi_old, mu, per_sequence = parts
    if log_ratio.numel() == 0:
        return {}
    token_q = torch.quantile(log_ratio.double(), torch.tensor([0.01, 0.5, 0.99], dtype=torch.float64)).exp()
    sequence_q = torch.quantile(per_sequence.double(), torch.tensor([0.01, 0.5, 0.99], dtype=torch.float64)).exp()
    figures = {
        "mismatch_tokens": float(log_ratio.numel()),
        "mismatch_kl": float((torch.exp(-log_ratio.double()) + log_ratio.double() - 1).mean()),
        "mismatch_token_p01": float(token_q[0]),
        "mismatch_token_p50": float(token_q[1]),
        "mismatch_token_p99": float(token_q[2]),
        "mismatch_sequence_p01": float(sequence_q[0]),
        "mismatch_sequence_p50": float(sequence_q[1]),
        "mismatch_sequence_p99": float(sequence_q[2]),
    }
    if mu.numel() > 1 and float(mu.std()) > 0 and float(pi_old.std()) > 0:
        figures["mismatch_logprob_corr"] = float(torch.corrcoef(torch.stack([pi_old, mu]).double())[0, 1])
    return figures


def aggregate(
    per_token: torch.Tensor,
    weights: torch.Tensor,
    spans: list[tuple[int, int]],
    config: LearnerConfig,
    tokens: float,
    sequences: float,
) -> torch.Tensor:
    """This micro-batch's share of the mini-batch's loss from each entry's loss, as ``--loss-aggregation``
    says: "token-mean" (summed, over the mini-batch's ``tokens`` trained tokens), or per sequence (a
    sequence's entries are one span of the micro-batch) then over the mini-batch's ``sequences``: its tokens'
    sum ("seq-mean-token-sum"), their mean ("seq-mean-token-mean"), or their sum over ``loss_norm_length``
    ("seq-mean-token-sum-norm", Dr. GRPO's constant). The normalisers are the whole mini-batch's, on every
    rank, so the shares of every micro-batch and rank add up to the loss."""
    weighted = per_token * weights.to(per_token.dtype)
    mode = config.loss_aggregation
    if mode == "token-mean":
        return weighted.sum() / tokens
    sums = torch.stack([weighted[start:end].sum() for start, end in spans]) if spans else weighted.sum()[None]
    if mode == "seq-mean-token-mean":
        counts = torch.tensor(
            [max(end - start, 1) for start, end in spans] or [1], dtype=sums.dtype, device=sums.device
        )
        return (sums / counts).sum() / sequences
    if mode == "seq-mean-token-sum-norm":
        return sums.sum() / (sequences * config.loss_norm_length)
    return sums.sum() / sequences


def _ratio(logprobs: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    return torch.exp(logprobs - old)


def ppo_terms(
    logprobs: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor, weights: torch.Tensor, low: float, high: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped surrogate per token: ``-min(r A, clip(r, 1 - low, 1 + high) A)``, ``r = pi / pi_old``."""
    ratio = _ratio(logprobs, old)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - low, 1.0 + high) * advantages
    return -torch.minimum(unclipped, clipped), _clip_stats(ratio, unclipped, clipped, logprobs - old, weights)


def gspo_terms(
    logprobs: torch.Tensor,
    old: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    spans: list[tuple[int, int]],
    low: float,
    high: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO (Zheng et al. 2025): the clipped surrogate with one ratio per sequence, the geometric mean of its
    tokens' ratios ``s = exp(mean_t log(pi_t / pi_old_t))`` (length-normalised), at each of its tokens:
    ``-min(s A_t, clip(s, 1 - low, 1 + high) A_t)``. Every token's gradient goes through ``s``, so a
    change of one token's log-prob moves the weight of every token of its sequence."""
    log_ratio = logprobs - old
    sums, lengths, index = _per_sequence(spans, log_ratio)
    sequence_ratio = torch.exp(sums / lengths)[index]
    unclipped = sequence_ratio * advantages
    clipped = torch.clamp(sequence_ratio, 1.0 - low, 1.0 + high) * advantages
    stats = _clip_stats(sequence_ratio, unclipped, clipped, log_ratio, weights)
    return -torch.minimum(unclipped, clipped), stats


def cispo_terms(
    logprobs: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor, weights: torch.Tensor, cap: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO (MiniMax-M1): the policy gradient weighted by the ratio clipped from above and without gradient,
    ``-sg(min(r, cap)) A log pi``: no token's gradient is dropped, however far its ratio (ScaleRL's cap 5)."""
    ratio = _ratio(logprobs, old)
    capped = torch.clamp(ratio, max=cap).detach()
    stats = _clip_stats(ratio, ratio * advantages, capped * advantages, logprobs - old, weights)
    return -capped * advantages * logprobs, stats


def sapo_terms(
    logprobs: torch.Tensor,
    old: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    tau_pos: float,
    tau_neg: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """SAPO (soft adaptive policy optimization): a smooth gate in place of the clip,
    ``-(4 / tau) sigmoid(tau (r - 1)) A`` with temperature ``tau_pos`` where ``A > 0`` and ``tau_neg``
    elsewhere: at ``r = 1`` its gradient is the plain policy gradient's, and it fades as ``r`` leaves 1."""
    ratio = _ratio(logprobs, old)
    tau = torch.where(advantages > 0, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg))
    gated = torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau
    stats = _clip_stats(ratio, ratio * advantages, ratio * advantages, logprobs - old, weights)
    return -gated * advantages, stats


def importance_terms(
    logprobs: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    """Importance-sampled REINFORCE as Tinker's ``importance_sampling``: ``-(pi / q) A``, no clip."""
    ratio = _ratio(logprobs, old)
    return -ratio * advantages, _clip_stats(ratio, ratio * advantages, ratio * advantages, logprobs - old, weights)


def dro_terms(
    logprobs: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor, weights: torch.Tensor, beta: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """DRO (Richemond et al. 2024) as Tinker's ``dro``: ``-(A log pi - (beta / 2) (log pi - log q)^2)``, a
    quadratic penalty in place of a clip."""
    log_ratio = logprobs - old
    ratio = torch.exp(log_ratio)
    stats = _clip_stats(ratio, ratio * advantages, ratio * advantages, log_ratio, weights)
    return -(advantages * logprobs - 0.5 * beta * log_ratio * log_ratio), stats


def tis_terms(
    logprobs: torch.Tensor, behaviour: torch.Tensor, advantages: torch.Tensor, weights: torch.Tensor, cap: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated importance sampling on the plain policy gradient (``--off-policy tis``), per token::

        w = min(pi_theta / pi_behaviour, cap)          (no gradient)
        gradient = -w * A * grad log pi_theta

    written as ``-w * A * exp(log pi - sg(log pi))``, whose value is ``-w * A``."""
    with torch.no_grad():
        raw = torch.exp(logprobs - behaviour)
        is_weight = torch.clamp(raw, max=cap)
    score = torch.exp(logprobs - logprobs.detach())  # 1, with the gradient of log pi
    stats = _weight_stats(raw, cap, logprobs - behaviour, weights)
    stats["approx_kl"] = stats.pop("kl")
    with torch.no_grad():
        stats["ratio_mean"] = float((raw * (weights != 0).to(weights.dtype)).sum() / _count(weights))
    return -is_weight * advantages * score, stats


def _sequence_index(spans: list[tuple[int, int]], entries: int, device: torch.device) -> torch.Tensor:
    """Each entry's sequence (its span's number) ``[E]``."""
    index = torch.zeros(entries, dtype=torch.long)
    for number, (start, end) in enumerate(spans):
        index[start:end] = number
    return index.to(device)


def _per_sequence(
    spans: list[tuple[int, int]], values: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each sequence's sum of ``values`` ``[S]`` (with their gradient), its entry count (at least 1), and each
    entry's sequence ``[E]``."""
    index = _sequence_index(spans, values.shape[0], values.device)
    sums = torch.zeros(len(spans), dtype=values.dtype, device=values.device).index_add(0, index, values)
    lengths = torch.zeros_like(sums).index_add(0, index, torch.ones_like(values)).clamp(min=1.0)
    return sums, lengths, index


def _reduce(per_token: torch.Tensor, weights: torch.Tensor, normaliser: float | None) -> torch.Tensor:
    denominator = normaliser if normaliser is not None else float(weights.sum().clamp(min=1.0))
    return (per_token * weights).sum() / denominator


def _count(weights: torch.Tensor) -> float:
    return float((weights != 0).sum().clamp(min=1))


def _clip_stats(
    ratio: torch.Tensor, unclipped: torch.Tensor, clipped: torch.Tensor, log_ratio: torch.Tensor, weights: torch.Tensor
) -> dict[str, float]:
    """Means over the tokens present: how many the clip held, the ratio, and KL's k3 estimate."""
    with torch.no_grad():
        present = (weights != 0).to(weights.dtype)
        count = _count(weights)
        return {
            "clip_fraction": float(((unclipped != clipped).to(weights.dtype) * present).sum() / count),
            "ratio_mean": float((ratio * present).sum() / count),
            "approx_kl": float((((ratio - 1) - log_ratio) * present).sum() / count),
        }


def _weight_stats(raw: torch.Tensor, cap: float, log_ratio: torch.Tensor, weights: torch.Tensor) -> dict[str, float]:
    """Means over the tokens present of an importance weight ``raw`` (= exp(log_ratio)) truncated at
    ``cap``: the weight, the fraction truncated, and the k3 KL estimate ("kl") it implies."""
    with torch.no_grad():
        present = (weights != 0).to(weights.dtype)
        count = _count(weights)
        return {
            "is_weight_mean": float((torch.clamp(raw, max=cap) * present).sum() / count),
            "is_truncated_fraction": float(((raw > cap).to(weights.dtype) * present).sum() / count),
            "kl": float((((raw - 1) - log_ratio) * present).sum() / count),
        }


def k3_kl(logprobs: torch.Tensor, reference_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || pi_ref) at tokens sampled from pi: ``exp(d) - d - 1``,
    ``d = log pi_ref - log pi``."""
    d = reference_logprobs - logprobs
    return torch.exp(d) - d - 1.0


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float = 0.2,
    normaliser: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """``0.5 * max((V - R)^2, (V_old + clip(V - V_old, -clip, clip) - R)^2)`` per token."""
    weights = mask.to(values.dtype)
    clipped = old_values + torch.clamp(values - old_values, -clip, clip)
    unclipped_error = (values - returns) ** 2
    clipped_error = (clipped - returns) ** 2
    per_token = 0.5 * torch.maximum(unclipped_error, clipped_error)
    loss = _reduce(per_token, weights, normaliser)
    with torch.no_grad():
        present = (weights != 0).to(weights.dtype)
        count = _count(weights)
        stats = {
            "value_mean": float((values * present).sum() / count),
            "value_error": float((unclipped_error * present).sum() / count),
            "value_clip_fraction": float(((clipped_error > unclipped_error).to(weights.dtype) * present).sum() / count),
        }
    return loss, stats


def dpo_weights(logps: torch.Tensor, reference: torch.Tensor, beta: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Sequences in pairs (``[chosen0, rejected0, chosen1, ...]``), each with its summed log-prob under the
    policy (``logps``) and the reference (``reference``): each sequence's weight (``+w`` for a chosen one,
    ``-w`` for a rejected one, averaged over the pairs) and the batch's figures: the loss, the implicit
    reward margin ``beta * margin`` (``reward_margin``), the share of pairs it orders right
    (``accuracy``) and the plain log-prob margin ``log pi(chosen) - log pi(rejected)`` (``logp_margin``)."""
    if logps.numel() % 2 or logps.shape != reference.shape:
        raise ValueError("DPO takes sequences in (chosen, rejected) pairs, each with its reference log-prob")
    logps, reference = logps.double(), reference.double()
    z = beta * ((logps[0::2] - reference[0::2]) - (logps[1::2] - reference[1::2]))
    pairs = z.numel()
    weight = beta * torch.sigmoid(-z) / pairs
    figures = {
        "dpo_loss": float(torch.nn.functional.softplus(-z).mean()),
        "reward_margin": float(z.mean()),
        "accuracy": float((z > 0).double().mean()),
        "logp_margin": float((logps[0::2] - logps[1::2]).mean()),
    }
    return torch.stack([weight, -weight], dim=1).reshape(-1), figures
