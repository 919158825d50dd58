"""Loss and advantage functions against naive per-element references on hand-made tensors."""

import math

import pytest
import torch

from agentjet_server.learner.losses import (
    clipped_policy_loss,
    clipped_value_loss,
    decoupled_policy_loss,
    k3_kl,
    tis_policy_loss,
)


def test_clipped_loss_matches_naive_per_token():
    logp = torch.tensor([[-0.5, -1.0, -2.0], [-0.1, -3.0, -0.7]])
    old = torch.tensor([[-1.0, -1.0, -1.0], [-0.5, -0.2, -0.7]])
    adv = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    lo, hi = 0.2, 0.28
    total, count = 0.0, 0
    for i in range(2):
        for j in range(3):
            if not mask[i, j]:
                continue
            r = math.exp(logp[i, j].item() - old[i, j].item())
            a = adv[i, j].item()
            total += -min(r * a, min(max(r, 1 - lo), 1 + hi) * a)
            count += 1
    loss, stats = clipped_policy_loss(logp, old, adv, mask, lo, hi)
    assert loss.item() == pytest.approx(total / count, rel=1e-6)
    assert 0 < stats["clip_fraction"] <= 1
    loss_norm, _ = clipped_policy_loss(logp, old, adv, mask, lo, hi, normaliser=10.0)
    assert loss_norm.item() == pytest.approx(total / 10.0, rel=1e-6)


def test_clipped_loss_gradient_pushes_up_positive_advantage():
    logp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    loss, _ = clipped_policy_loss(logp, logp.detach(), torch.tensor([[1.0, -1.0]]), torch.ones(1, 2))
    loss.backward()
    assert logp.grad[0, 0] < 0 < logp.grad[0, 1]  # descent raises the first, lowers the second


LOGP = [-0.5, -1.0, -2.0, -0.1, -3.0, -0.7]
PROX = [-0.6, -1.1, -1.0, -0.2, -2.5, -0.7]
BEHAVIOUR = [-1.0, -3.0, -1.0, -0.5, -0.2, -0.7]
ADV = [1.0, 1.0, -1.0, -2.0, 0.5, 2.0]
WEIGHTS = [1.0, 1.0, 0.0, 1.0, 0.5, 1.0]  # one token left out, one down-weighted


def _tensors(*rows, grad=False):
    return [torch.tensor(r, dtype=torch.float64, requires_grad=grad and i == 0) for i, r in enumerate(rows)]


def test_decoupled_loss_matches_naive_per_token():
    lo, hi, cap = 0.2, 0.28, 2.0
    total = 0.0
    for lp, px, bh, a, w in zip(LOGP, PROX, BEHAVIOUR, ADV, WEIGHTS, strict=False):
        is_weight = min(math.exp(px - bh), cap)
        r = math.exp(lp - px)
        total += -w * is_weight * min(r * a, min(max(r, 1 - lo), 1 + hi) * a)
    logp, prox, behaviour, adv, weights = _tensors(LOGP, PROX, BEHAVIOUR, ADV, WEIGHTS)
    loss, stats = decoupled_policy_loss(logp, prox, behaviour, adv, weights, lo, hi, cap, normaliser=7.0)
    assert loss.item() == pytest.approx(total / 7.0, rel=1e-12)
    raw = [math.exp(p - b) for p, b, w in zip(PROX, BEHAVIOUR, WEIGHTS, strict=False) if w]
    assert stats["is_truncated_fraction"] == pytest.approx(sum(r > cap for r in raw) / len(raw))
    assert stats["is_weight_mean"] == pytest.approx(sum(min(r, cap) for r in raw) / len(raw))


def test_decoupled_loss_equals_clipped_loss_when_nothing_is_stale():
    """pi_prox == pi_behaviour: weight 1, the decoupled objective is PPO's clip around them."""
    logp, behaviour, adv, weights = _tensors(LOGP, BEHAVIOUR, ADV, WEIGHTS)
    a, _ = decoupled_policy_loss(logp, behaviour, behaviour, adv, weights)
    b, _ = clipped_policy_loss(logp, behaviour, adv, weights)
    assert a.item() == pytest.approx(b.item(), rel=1e-12)


def test_decoupled_gradient_is_weighted_by_the_truncated_importance_weight():
    """At theta == prox (the first update of a batch) the clip is inactive: the gradient is
    -w * A * grad log pi per token, w = min(pi_prox / pi_behaviour, cap), times the token's weight."""
    cap = 2.0
    logp = torch.tensor(PROX, dtype=torch.float64, requires_grad=True)
    _, prox, behaviour, adv, weights = _tensors(LOGP, PROX, BEHAVIOUR, ADV, WEIGHTS)
    loss, _ = decoupled_policy_loss(logp, prox, behaviour, adv, weights, is_cap=cap, normaliser=1.0)
    loss.backward()
    expected = [-w * min(math.exp(p - b), cap) * a for p, b, a, w in zip(PROX, BEHAVIOUR, ADV, WEIGHTS, strict=False)]
    assert logp.grad.tolist() == pytest.approx(expected, rel=1e-12)


def test_tis_loss_gradient_matches_naive_truncated_weights():
    cap = 2.0
    logp = torch.tensor(LOGP, dtype=torch.float64, requires_grad=True)
    _, behaviour, adv, weights = _tensors(LOGP, BEHAVIOUR, ADV, WEIGHTS)
    loss, stats = tis_policy_loss(logp, behaviour, adv, weights, cap, normaliser=4.0)
    loss.backward()
    rows = list(zip(LOGP, BEHAVIOUR, ADV, WEIGHTS, strict=True))
    per_token = [-w * min(math.exp(lp - b), cap) * a for lp, b, a, w in rows]
    expected_grad = [g / 4.0 for g in per_token]
    expected_value = sum(per_token)
    assert logp.grad.tolist() == pytest.approx(expected_grad, rel=1e-12)
    assert loss.item() == pytest.approx(expected_value / 4.0, rel=1e-12)
    assert 0 < stats["is_truncated_fraction"] < 1


def test_k3_kl_matches_naive_and_is_zero_only_at_the_reference():
    reference = [-0.4, -2.0, -2.0, -0.1, -0.5, -1.7]
    expected = [math.exp(r - lp) - (r - lp) - 1 for lp, r in zip(LOGP, reference, strict=False)]
    got = k3_kl(torch.tensor(LOGP, dtype=torch.float64), torch.tensor(reference, dtype=torch.float64))
    assert got.tolist() == pytest.approx(expected, rel=1e-12)
    assert all(v >= 0 for v in got.tolist())
    assert got[2].item() == 0 and got[3].item() == 0  # the same log-prob: no divergence
    # the sampled estimate converges to KL(p || q) on a small categorical
    p, q = torch.tensor([0.7, 0.2, 0.1]), torch.tensor([0.4, 0.4, 0.2])
    draws = torch.multinomial(p, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    estimate = k3_kl(p.log()[draws], q.log()[draws]).mean().item()
    assert estimate == pytest.approx(float((p * (p / q).log()).sum()), rel=0.02)


def test_clipped_value_loss_matches_naive():
    values = [0.5, 1.0, -0.2, 0.0]
    old = [0.0, 0.9, 0.3, 0.0]
    returns = [1.0, 0.0, -1.0, 0.1]
    weights = [1.0, 1.0, 0.5, 0.0]
    clip = 0.2
    total = 0.0
    for v, o, r, w in zip(values, old, returns, weights, strict=False):
        clipped = o + min(max(v - o, -clip), clip)
        total += w * 0.5 * max((v - r) ** 2, (clipped - r) ** 2)
    loss, stats = clipped_value_loss(*_tensors(values, old, returns, weights), clip=clip, normaliser=3.0)
    assert loss.item() == pytest.approx(total / 3.0, rel=1e-12)
    assert 0 < stats["value_clip_fraction"] < 1
