"""GRPO's advantages (``learner.advantages``) against naive references on hand-made tensors and trajectories."""

import math
import statistics

import pytest
import torch

from agentjet_client.protocol import Trajectory, Turn
from agentjet_server.learner.advantages import group_advantages
from agentjet_server.learner.batch import build_batch
from tests.server.learner.groups import _turn


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


def episode(i: int, reward: float, agent_rewards: dict[str, float] | None = None):

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


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce_pp", "passk"])
def test_each_group_estimator_matches_its_formula(estimator):
    from agentjet_server.learner.advantages import estimated

    rewards = [1.0, 0.0, 0.5, 0.0, 1.0, 0.25]
    n, mean = len(rewards), sum(rewards) / len(rewards)
    std = (sum((r - mean) ** 2 for r in rewards) / n) ** 0.5
    if estimator == "grpo":
        expected = [(r - mean) / (std + 1e-6) for r in rewards]
    elif estimator in ("dr_grpo", "reinforce_pp"):  # reinforce_pp's batch whitening comes after
        expected = [r - mean for r in rewards]
    elif estimator == "rloo":  # each against the mean of the others
        expected = [r - (sum(rewards) - r) / (n - 1) for r in rewards]
    else:  # passk: the best one alone, by its lead over the second best
        expected = [(1.0 - 1.0) / (std + 1e-6)] + [0.0] * (n - 1)
    got = estimated(torch.tensor(rewards, dtype=torch.float64), estimator).tolist()
    assert got == pytest.approx(expected, abs=1e-9)


def test_passk_rewards_the_best_episode_by_its_lead_alone():
    from agentjet_server.learner.advantages import estimated

    got = estimated(torch.tensor([0.2, 0.9, 0.5, 0.1], dtype=torch.float64), "passk").tolist()
    std = statistics.pstdev([0.2, 0.9, 0.5, 0.1])
    assert got == pytest.approx([0.0, 0.4 / (std + 1e-6), 0.0, 0.0], abs=1e-9)


def test_reinforce_pp_whitens_the_group_baselines_over_every_token_of_the_batch():
    def group(task: str, rewards: list[float], tokens: list[int]) -> list[Trajectory]:
        return [
            Trajectory(id=f"{task}{i}", task_id=task, turns=[_turn_of(n)], reward=r)
            for i, (r, n) in enumerate(zip(rewards, tokens, strict=True))
        ]

    groups = [group("a", [1.0, 0.0], [2, 3]), group("b", [0.5, 0.0, 1.0], [1, 1, 2])]
    batch = build_batch(groups, estimator="reinforce_pp")
    baselines = [0.5, -0.5, 0.0, -0.5, 0.5]  # each reward minus its group's mean
    per_token = [b for b, n in zip(baselines, [2, 3, 1, 1, 2], strict=True) for _ in range(n)]
    mean, std = sum(per_token) / len(per_token), statistics.pstdev(per_token)
    got = [a for s in batch.sequences for a in s.advantages]
    assert got == pytest.approx([(a - mean) / (std + 1e-8) for a in per_token], abs=1e-9)
    assert abs(sum(got)) < 1e-9


def _turn_of(completion_tokens: int) -> Turn:
    return _turn([1, 2, 3], list(range(10, 10 + completion_tokens)), [0] * completion_tokens)
