"""The learner's objective: one micro-batch's loss (``objective``) and the pure loss functions it is made
of (tensors in, tensors out). The advantages they weigh tokens by come from the batch (``learner.batch``:
GRPO's group advantages) or from the no-gradient pass before the update (``learner.prepare``: PPO's GAE,
the teacher's per-token advantage, DPO's sequence weights).

Policy losses (``--policy-loss``, per trained token: ``*_terms``; docs/objectives.md has each formula and its
reference): ``ppo_terms`` (the clipped ratio), ``gspo_terms`` (one length-normalised ratio per sequence),
``cispo_terms`` (a capped stop-gradient weight on log pi), ``sapo_terms`` (a soft gate), ``importance_terms``
and ``dro_terms`` (Tinker's forms). ``policy_terms`` picks one and applies ``--off-policy``; ``aggregate``
turns the tokens' losses into the mini-batch's share (``--loss-aggregation``).

The off-policy modes as reduced losses (per trained token, weighted, summed and divided by ``normaliser``)
* ``clipped_policy_loss`` — PPO's clipped surrogate against the *behaviour* log-probs the engine
  recorded when it sampled (``--off-policy none``). At high staleness the behaviour policy is
  many versions old, and one clip around it both corrects for staleness and bounds the update:
  the AReaL paper's "naive PPO", which degrades as staleness grows.
* ``decoupled_policy_loss`` — AReaL's decoupled objective (``--off-policy decoupled``): the clip
  is taken around a *proximal* policy (the weights about to be updated) and the staleness is
  corrected separately by the importance weight ``pi_prox / pi_behaviour``, truncated at a cap.
* ``tis_policy_loss`` — truncated importance sampling on the plain policy gradient (``tis``):
  each token's gradient ``A * grad log pi`` weighted by ``min(pi / pi_behaviour, cap)``, no clip.

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

import torch

from agentjet_server.learner.batch import Mode
from agentjet_server.learner.config import LearnerConfig
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


def policy_terms(
    config: LearnerConfig, logprobs: torch.Tensor, part: MicroBatch
) -> tuple[torch.Tensor, dict[str, float]]:
    """Each entry's policy loss ``[E]`` (unweighted, not aggregated) and the figures: the loss of
    ``--policy-loss`` against the proximal log-probs (``--off-policy decoupled``, then weighted by the
    truncated ``pi_prox / pi_behaviour``) or the behaviour ones (``none``); ``tis`` is a loss of its own."""
    behaviour, advantages, weights = part.old_logprobs, part.advantages, part.weights
    if config.off_policy == "tis":
        return tis_terms(logprobs, behaviour, advantages, weights, config.is_cap)
    old = behaviour
    if config.off_policy == "decoupled":
        assert part.proximal_logprobs is not None
        old = part.proximal_logprobs
    name = config.policy_loss
    if name == "ppo":
        per_token, stats = ppo_terms(logprobs, old, advantages, weights, config.clip_low, config.clip_high)
    elif name == "gspo":
        per_token, stats = gspo_terms(logprobs, old, advantages, weights, part.spans, config.clip_low, config.clip_high)
    elif name == "cispo":
        per_token, stats = cispo_terms(logprobs, old, advantages, weights, config.cispo_cap)
    elif name == "sapo":
        per_token, stats = sapo_terms(logprobs, old, advantages, weights, config.sapo_tau_pos, config.sapo_tau_neg)
    elif name == "importance_sampling":
        per_token, stats = importance_terms(logprobs, old, advantages, weights)
    else:
        per_token, stats = dro_terms(logprobs, old, advantages, weights, config.dro_beta)
    if config.off_policy == "decoupled":
        with torch.no_grad():
            raw = torch.exp(old - behaviour)
        weight_stats = _weight_stats(raw, config.is_cap, old - behaviour, weights)
        stats.update(weight_stats, behaviour_kl=weight_stats.pop("kl"))
        per_token = torch.clamp(raw, max=config.is_cap) * per_token
    return per_token, stats


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
    index = _sequence_index(spans, log_ratio.shape[0], log_ratio.device)
    lengths = torch.zeros(len(spans), dtype=log_ratio.dtype, device=log_ratio.device)
    lengths.index_add_(0, index, torch.ones_like(log_ratio))
    means = torch.zeros(len(spans), dtype=log_ratio.dtype, device=log_ratio.device).index_add(0, index, log_ratio)
    sequence_ratio = torch.exp(means / lengths.clamp(min=1.0))[index]
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


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    normaliser: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate (``ppo_terms``), weighted by ``mask`` (1 trains a token, 0 leaves it out, a fraction
    down-weights it), summed and divided by ``normaliser``.

    ``normaliser`` defaults to the sum of ``mask``; pass the whole batch's token count when the
    batch is split into micro-batches so that gradients add up to the token mean.
    """
    weights = mask.to(logprobs.dtype)
    per_token, stats = ppo_terms(logprobs, old_logprobs, advantages, weights, clip_low, clip_high)
    return _reduce(per_token, weights, normaliser), stats


def decoupled_policy_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    is_cap: float = 2.0,
    normaliser: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """AReaL's decoupled PPO objective, per token::

        w = min(pi_prox / pi_behaviour, is_cap)          (no gradient)
        r = pi_theta / pi_prox
        loss = -w * min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)

    The clip keeps the update near the proximal policy (the weights being updated), whatever the
    staleness; the truncated weight corrects for the turn having been sampled by an older one.
    """
    weights = mask.to(logprobs.dtype)
    with torch.no_grad():
        raw = torch.exp(proximal_logprobs - behaviour_logprobs)
    per_token, stats = ppo_terms(logprobs, proximal_logprobs, advantages, weights, clip_low, clip_high)
    weight_stats = _weight_stats(raw, is_cap, proximal_logprobs - behaviour_logprobs, weights)
    stats.update(weight_stats, behaviour_kl=weight_stats.pop("kl"))
    return _reduce(torch.clamp(raw, max=is_cap) * per_token, weights, normaliser), stats


def tis_policy_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    is_cap: float = 2.0,
    normaliser: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """``tis_terms`` weighted by ``mask``, summed and divided by ``normaliser``."""
    weights = mask.to(logprobs.dtype)
    per_token, stats = tis_terms(logprobs, behaviour_logprobs, advantages, weights, is_cap)
    return _reduce(per_token, weights, normaliser), stats


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
