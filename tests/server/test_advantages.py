"""Both advantage estimators against naive references on hand-made tensors and trajectories."""

import math

import pytest
import torch

from agentjet_server.learner.advantages import gae, group_advantages


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


def test_gae_matches_the_naive_sum():
    rewards = [0.0, 0.5, 0.0, 0.0, 1.0]
    values = [0.2, -0.1, 0.4, 0.3, 0.6]
    gamma, lam = 0.9, 0.8
    n = len(rewards)
    deltas = [rewards[t] + gamma * (values[t + 1] if t + 1 < n else 0.0) - values[t] for t in range(n)]
    expected = [sum((gamma * lam) ** (k - t) * deltas[k] for k in range(t, n)) for t in range(n)]
    adv, returns = gae(
        torch.tensor(rewards, dtype=torch.float64), torch.tensor(values, dtype=torch.float64), gamma, lam
    )
    assert adv.tolist() == pytest.approx(expected, rel=1e-12)
    assert returns.tolist() == pytest.approx([a + v for a, v in zip(expected, values, strict=False)], rel=1e-12)
    # lambda = 1, gamma = 1: the advantage is the return to go minus the value
    adv1, ret1 = gae(torch.tensor(rewards), torch.tensor(values), 1.0, 1.0)
    to_go = [sum(rewards[t:]) for t in range(n)]
    assert ret1.tolist() == pytest.approx(to_go, abs=1e-6)
    assert adv1.tolist() == pytest.approx([g - v for g, v in zip(to_go, values, strict=False)], abs=1e-6)
    with pytest.raises(ValueError):
        gae(torch.zeros(3), torch.zeros(4), 1.0, 1.0)


def episode(i: int, reward: float, agent_rewards: dict[str, float] | None = None):
    from agentjet_client.protocol import Trajectory, Turn

    turn = Turn(
        agent="planner",
        policy_version=0,
        prompt_token_ids=[1],
        completion_token_ids=[2],
        completion_logprobs=[-1.0],
        finish_reason="stop",
    )
    return Trajectory(id=f"t{i}", task_id="task", turns=[turn], reward=reward, agent_rewards=agent_rewards)


def test_episode_advantages_normalise_each_agent_among_the_same_agent_of_the_siblings():
    from agentjet_server.learner.advantages import episode_advantages

    group = [
        episode(0, 1.0, {"planner": 1.0, "executor": 0.0}),
        episode(1, 0.0, {"planner": 0.0, "executor": 0.0}),
        episode(2, 0.5, {"planner": 0.0}),  # no executor reward: the episode's stands in for it
    ]
    out = episode_advantages(group)

    def naive(values: list[float]) -> list[float]:
        mean = sum(values) / len(values)
        std = math.sqrt(sum((x - mean) ** 2 for x in values) / len(values))
        return [(v - mean) / (std + 1e-6) for v in values]

    for key, values in (("", [1.0, 0.0, 0.5]), ("planner", [1.0, 0.0, 0.0]), ("executor", [0.0, 0.0, 0.5])):
        assert [a[key] for a in out] == pytest.approx(naive(values), abs=1e-9), key
    assert episode_advantages([episode(0, 0.3), episode(1, 0.3)]) == [{"": 0.0}, {"": 0.0}]  # no signal
