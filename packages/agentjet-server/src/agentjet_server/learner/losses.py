"""Pure loss functions of the learner: no state, no I/O, tensors in and tensors out. The advantages
they weigh tokens by come from ``learner.advantages``.

Policy objectives (per trained token, weighted, summed and divided by ``normaliser``)
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
    """Clipped surrogate, weighted by ``mask`` (1 trains a token, 0 leaves it out, a fraction
    down-weights it), summed and divided by ``normaliser``.

    ``normaliser`` defaults to the sum of ``mask``; pass the whole batch's token count when the
    batch is split into micro-batches so that gradients add up to the token mean.
    """
    weights = mask.to(logprobs.dtype)
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    stats = _clip_stats(ratio, unclipped, clipped, logprobs - old_logprobs, weights)
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
        is_weight = torch.clamp(raw, max=is_cap)
    ratio = torch.exp(logprobs - proximal_logprobs)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    per_token = -is_weight * torch.minimum(unclipped, clipped)
    stats = _clip_stats(ratio, unclipped, clipped, logprobs - proximal_logprobs, weights)
    weight_stats = _weight_stats(raw, is_cap, proximal_logprobs - behaviour_logprobs, weights)
    stats.update(weight_stats, behaviour_kl=weight_stats.pop("kl"))
    return _reduce(per_token, weights, normaliser), stats


def tis_policy_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    is_cap: float = 2.0,
    normaliser: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated importance sampling on the plain policy gradient, per token::

        w = min(pi_theta / pi_behaviour, is_cap)          (no gradient)
        gradient = -w * A * grad log pi_theta

    written as ``-w * A * exp(log pi - sg(log pi))``, whose value is ``-w * A``.
    """
    weights = mask.to(logprobs.dtype)
    with torch.no_grad():
        raw = torch.exp(logprobs - behaviour_logprobs)
        is_weight = torch.clamp(raw, max=is_cap)
    score = torch.exp(logprobs - logprobs.detach())  # 1, with the gradient of log pi
    per_token = -is_weight * advantages * score
    stats = _weight_stats(raw, is_cap, logprobs - behaviour_logprobs, weights)
    stats["approx_kl"] = stats.pop("kl")
    with torch.no_grad():
        stats["ratio_mean"] = float((raw * (weights != 0).to(weights.dtype)).sum() / _count(weights))
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
