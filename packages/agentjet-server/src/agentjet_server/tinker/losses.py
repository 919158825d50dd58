"""The Tinker API's built-in losses, each a sum over one datum's tokens (Tinker's convention: the caller
scales with ``weights`` or ``advantages``; nothing is averaged). ``logp`` are the trained policy's
log-probabilities of ``target_tokens``; ``q`` the sampler's (``loss_fn_inputs["logprobs"]``), ``A`` the
advantages, ``r = exp(logp - q)`` the importance ratio, ``sg`` a stop-gradient:

- ``cross_entropy``: ``-sum(weights * logp)`` (weights may be negative: a client-side custom loss sends its
  gradient this way);
- ``importance_sampling``: ``-sum(r * A)``;
- ``ppo``: ``-sum(min(r * A, clip(r, low, high) * A))``, ``clip_low_threshold`` 0.8 and
  ``clip_high_threshold`` 1.2 unless ``loss_fn_config`` names others, or the datum gives them per token (as
  ``loss_fn_inputs`` of those names, also for cispo and gspo);
- ``cispo``: ``-sum(sg(clip(r, low, high)) * logp * A)``, the same thresholds;
- ``dro``: ``-sum(logp * A - beta / 2 * (logp - q)^2)``, ``beta`` 0.05 unless configured;
- ``gspo``: the ratio per sequence, ``s = exp(mean(logp - q))`` over the tokens that carry an advantage, in
  its per-token form ``sg(s) * exp(logp - sg(logp))``, clipped as in PPO with thresholds ``1 - 3e-4`` and
  ``1 + 4e-4`` unless configured (``loss_fn_inputs["mask"]`` may name the tokens instead);
- ``stable_reinforce``: REINFORCE on data that may be off-policy, against the sampler's log-probabilities the
  server kept for the datum's sampled sequences (its provenance, checked by the workbench):
  ``-sum(m * sg(min(r, is_cap)) * logp * A)``, where ``m`` drops the tokens whose ratio lies outside
  ``[1 / mask_bound, mask_bound]`` (``is_cap`` 2, ``mask_bound`` 5 unless configured). Tinker's hosted
  definition is not public; this is ours, stated in docs/tinker.md.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from agentjet_server.errors import InvalidRequestError

Config = dict[str, float | str]

REQUIRED = {
    "cross_entropy": ("target_tokens", "weights"),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
    "cispo": ("target_tokens", "logprobs", "advantages"),
    "dro": ("target_tokens", "logprobs", "advantages"),
    "gspo": ("target_tokens", "logprobs", "advantages"),
    "stable_reinforce": ("target_tokens", "logprobs", "advantages"),
}
KNOWN_CONFIG = {
    "cross_entropy": set(),
    "importance_sampling": set(),
    "ppo": {"clip_low_threshold", "clip_high_threshold"},
    "cispo": {"clip_low_threshold", "clip_high_threshold"},
    "dro": {"beta"},
    "gspo": {"clip_low_threshold", "clip_high_threshold"},
    "stable_reinforce": {"is_cap", "mask_bound"},
}
THRESHOLDS = {"clip_low_threshold", "clip_high_threshold"}  # per token, in place of the configured ones
OPTIONAL = {"ppo": THRESHOLDS, "cispo": THRESHOLDS, "gspo": THRESHOLDS | {"mask"}}


def check(loss_fn: str, config: Config) -> None:
    """A 400 for a loss this server does not know or a configuration key it would ignore."""
    if loss_fn not in REQUIRED:
        raise InvalidRequestError(
            f"unknown loss_fn {loss_fn!r}: this server offers {', '.join(REQUIRED)}", param="loss_fn"
        )
    unknown = sorted(set(config) - KNOWN_CONFIG[loss_fn])
    if unknown:
        known = ", ".join(sorted(KNOWN_CONFIG[loss_fn])) or "none"
        raise InvalidRequestError(
            f"loss_fn_config key {unknown[0]!r} does not apply to {loss_fn} (its keys: {known})", param="loss_fn_config"
        )
    for key, value in config.items():
        if not isinstance(value, float) or not value == value:
            raise InvalidRequestError(f"loss_fn_config {key!r} must be a number", param="loss_fn_config")


def _number(config: Config, key: str, default: float) -> float:
    value = config.get(key, default)
    return float(value) if isinstance(value, int | float) else default


Inputs = dict[str, torch.Tensor]
Bound = float | torch.Tensor


def _clip(config: Config, x: Inputs, low: float, high: float) -> tuple[Bound, Bound]:
    """The clip thresholds: the datum's per-token ones, else the configured, else the defaults."""
    lower = x.get("clip_low_threshold", _number(config, "clip_low_threshold", low))
    upper = x.get("clip_high_threshold", _number(config, "clip_high_threshold", high))
    return lower, upper


def _clamp(ratio: torch.Tensor, low: Bound, high: Bound) -> torch.Tensor:
    return torch.clamp(ratio, torch.as_tensor(low, dtype=ratio.dtype), torch.as_tensor(high, dtype=ratio.dtype))


def cross_entropy(logp: torch.Tensor, x: Inputs, config: Config) -> torch.Tensor:
    return -(x["weights"] * logp).sum()


def importance_sampling(logp: torch.Tensor, x: Inputs, config: Config) -> torch.Tensor:
    return -(torch.exp(logp - x["logprobs"]) * x["advantages"]).sum()


def ppo(logp: torch.Tensor, x: Inputs, config: Config) -> torch.Tensor:
    low, high = _clip(config, x, 0.8, 1.2)
    ratio, advantages = torch.exp(logp - x["logprobs"]), x["advantages"]
    return -torch.minimum(ratio * advantages, _clamp(ratio, low, high) * advantages).sum()


def cispo(logp: torch.Tensor, x: Inputs, config: Config) -> torch.Tensor:
    low, high = _clip(config, x, 0.8, 1.2)
    weight = _clamp(torch.exp(logp - x["logprobs"]), low, high).detach()
    return -(weight * logp * x["advantages"]).sum()


def dro(logp: torch.Tensor, x: Inputs, config: Config) -> torch.Tensor:
    beta = _number(config, "beta", 0.05)
    return -(logp * x["advantages"] - beta / 2 * (logp - x["logprobs"]) ** 2).sum()


def gspo(logp: torch.Tensor, x: Inputs, config: Config) -> torch.Tensor:
    low, high = _clip(config, x, 1 - 3e-4, 1 + 4e-4)
    advantages = x["advantages"]
    mask = (advantages != 0).to(logp.dtype) if "mask" not in x else x["mask"]
    count = mask.sum().clamp(min=1.0)
    sequence = torch.exp(((logp - x["logprobs"]) * mask).sum() / count)
    ratio = sequence.detach() * torch.exp(logp - logp.detach())
    return -(torch.minimum(ratio * advantages, _clamp(ratio, low, high) * advantages) * mask).sum()


def stable_reinforce(logp: torch.Tensor, x: Inputs, config: Config) -> torch.Tensor:
    cap, bound = _number(config, "is_cap", 2.0), _number(config, "mask_bound", 5.0)
    ratio = torch.exp(logp.detach() - x["logprobs"])
    keep = ((ratio >= 1 / bound) & (ratio <= bound)).to(logp.dtype)
    return -(keep * ratio.clamp(max=cap) * logp * x["advantages"]).sum()


LOSSES: dict[str, Callable[[torch.Tensor, Inputs, Config], torch.Tensor]] = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
    "dro": dro,
    "gspo": gspo,
    "stable_reinforce": stable_reinforce,
}
