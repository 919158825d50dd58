"""Loss and advantage functions against naive per-element references on hand-made tensors."""

import math

import pytest
import torch

from agentjet_server.learner.losses import clipped_policy_loss, group_advantages


def test_group_advantages_matches_naive():
    rewards = [1.0, 0.0, 0.0, 1.0, 0.5]
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    expected = [(r - mean) / (std + 1e-6) for r in rewards]
    got = group_advantages(torch.tensor(rewards, dtype=torch.float64)).tolist()
    assert got == pytest.approx(expected, abs=1e-9)


def test_group_advantages_equal_rewards_are_zero_and_bad_input_raises():
    assert group_advantages(torch.tensor([0.3, 0.3, 0.3])).abs().max() == 0
    with pytest.raises(ValueError):
        group_advantages(torch.tensor([]))


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
