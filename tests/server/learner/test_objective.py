"""Loss and advantage functions against naive per-element references on hand-made tensors."""

import math

import pytest
import torch

from agentjet_server.learner.config import LearnerConfig
from agentjet_server.learner.objective import aggregate, clipped_value_loss, k3_kl, policy_terms
from tests.server.learner.groups import micro_batch


def _policy_loss(config, logp, behaviour, adv, weights, proximal=None, normaliser=None):  # type: ignore[no-untyped-def]
    """The policy loss as the step computes it (``policy_terms``, then ``aggregate`` as a token mean over
    ``normaliser`` tokens, by default the weights' sum), on flat tensors of one sequence."""
    flat = [t.reshape(-1) for t in (logp, behaviour, adv, weights)]
    part = micro_batch(flat[1], flat[2], flat[3], proximal=None if proximal is None else proximal.reshape(-1))
    per_token, stats = policy_terms(config, flat[0], part)
    tokens = normaliser if normaliser is not None else float(flat[3].sum())
    return aggregate(per_token, flat[3], part.spans, config, tokens, 1.0), stats


def clipped_policy_loss(logp, old, adv, mask, lo=0.2, hi=0.28, normaliser=None):  # type: ignore[no-untyped-def]
    config = LearnerConfig(off_policy="none", clip_low=lo, clip_high=hi)
    return _policy_loss(config, logp, old, adv, mask.to(logp.dtype), normaliser=normaliser)


def decoupled_policy_loss(logp, prox, behaviour, adv, weights, lo=0.2, hi=0.28, cap=2.0, normaliser=None):  # type: ignore[no-untyped-def]
    config = LearnerConfig(off_policy="decoupled", clip_low=lo, clip_high=hi, is_cap=cap)
    return _policy_loss(config, logp, behaviour, adv, weights, proximal=prox, normaliser=normaliser)


def tis_policy_loss(logp, behaviour, adv, weights, cap=2.0, normaliser=None):  # type: ignore[no-untyped-def]
    config = LearnerConfig(off_policy="tis", is_cap=cap)
    return _policy_loss(config, logp, behaviour, adv, weights, normaliser=normaliser)


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
    loss, _ = decoupled_policy_loss(logp, prox, behaviour, adv, weights, cap=cap, normaliser=1.0)
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


def test_importance_sampling_and_dro_match_the_formulas_token_by_token():
    from agentjet_server.learner.objective import dro_terms, importance_terms

    logp = torch.tensor([-0.5, -1.2, -2.0, -0.3], requires_grad=True)
    old = torch.tensor([-0.7, -1.0, -2.5, -0.3])
    adv = torch.tensor([1.0, -0.5, 2.0, -1.0])
    weights = torch.ones(4)
    sampled, _ = importance_terms(logp, old, adv, weights)
    penalised, _ = dro_terms(logp, old, adv, weights, beta=0.3)
    for t in range(4):
        lp, q, a = logp[t].item(), old[t].item(), adv[t].item()
        assert sampled[t].item() == pytest.approx(-math.exp(lp - q) * a, rel=1e-6)  # Tinker: -(p/q) A
        assert penalised[t].item() == pytest.approx(-(lp * a - 0.15 * (lp - q) ** 2), rel=1e-6)
    (grad,) = torch.autograd.grad(penalised.sum(), logp)
    expected = [-(adv[t].item() - 0.3 * (logp[t].item() - old[t].item())) for t in range(4)]
    assert grad.tolist() == pytest.approx(expected, rel=1e-6)


def test_gspo_gives_every_token_of_a_sequence_one_ratio_whatever_version_sampled_each():
    """A multi-turn episode whose turns came from two versions is one sequence: changing one token's old
    log-prob moves the weight of every token of that sequence, and no token of another."""
    from agentjet_server.learner.objective import gspo_terms

    spans = [(0, 5), (5, 8)]  # a two-turn episode of 5 trained tokens, then another episode of 3
    logp = torch.tensor([-1.0, -0.8, -1.5, -0.2, -0.9, -1.1, -0.4, -0.6], requires_grad=True)
    old = torch.tensor([-1.1, -0.7, -1.6, -0.2, -1.0, -1.0, -0.5, -0.6])  # turn 1 from v3, turn 2 from v4
    adv, weights = torch.full((8,), 0.5), torch.ones(8)
    base, _ = gspo_terms(logp, old, adv, weights, spans, 10.0, 10.0)  # wide clip: the ratio itself
    moved_old = old.clone()
    moved_old[3] -= 0.4  # one token of the second turn
    moved, _ = gspo_terms(logp, moved_old, adv, weights, spans, 10.0, 10.0)
    changed = (moved - base).abs() > 1e-7
    assert changed[:5].all() and not changed[5:].any()
    ratio = math.exp(sum(lp - o for lp, o in zip(logp.tolist()[:5], old.tolist()[:5], strict=True)) / 5)
    assert base[:5].tolist() == pytest.approx([-0.5 * ratio] * 5, rel=1e-6)
    (grad,) = torch.autograd.grad(base[:5].sum(), logp)
    assert grad[:5].tolist() == pytest.approx([-0.5 * ratio] * 5, rel=1e-5)  # d(5 s A)/d logp_t = s A
    assert grad[5:].abs().max().item() == 0.0


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_each_aggregation_is_the_same_split_over_micro_batches_or_not(mode):
    """The normalisers are the mini-batch's: two micro-batches' shares add up to the whole batch's loss."""
    from agentjet_server.learner.config import LearnerConfig
    from agentjet_server.learner.objective import aggregate

    config = LearnerConfig(loss_aggregation=mode, loss_norm_length=6)
    per_token = torch.tensor([0.5, -1.0, 2.0, 0.25, -0.75, 1.5, 0.1])
    weights = torch.tensor([1.0, 1.0, 0.5, 1.0, 1.0, 1.0, 0.0])  # a down-weighted token, one left out
    spans = [(0, 3), (3, 5), (5, 7)]
    whole = aggregate(per_token, weights, spans, config, tokens=7.0, sequences=3.0)
    first = aggregate(per_token[:3], weights[:3], [(0, 3)], config, tokens=7.0, sequences=3.0)
    rest = aggregate(per_token[3:], weights[3:], [(0, 2), (2, 4)], config, tokens=7.0, sequences=3.0)
    assert (first + rest).item() == pytest.approx(whole.item(), rel=1e-6)
    sums = [0.5 - 1.0 + 1.0, 0.25 - 0.75, 1.5]
    expected = {
        "token-mean": sum(sums) / 7,
        "seq-mean-token-sum": sum(sums) / 3,
        "seq-mean-token-mean": (sums[0] / 3 + sums[1] / 2 + sums[2] / 2) / 3,
        "seq-mean-token-sum-norm": sum(sums) / (3 * 6),
    }[mode]
    assert whole.item() == pytest.approx(expected, rel=1e-6)
