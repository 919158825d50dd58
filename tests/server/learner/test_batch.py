"""Building a batch from groups: groups without signal and failed episodes left out, staleness measured again,
PPO's rewards placed on tokens."""

from __future__ import annotations

from agentjet_client.protocol import Trajectory
from agentjet_server.engine.tokens import load_tokenizer
from agentjet_server.learner.batch import build_batch
from tests.server.learner.groups import _turn, make_group


def test_build_batch_skips_groups_without_signal_and_failed_episodes(model_dir):
    tok = load_tokenizer(model_dir)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    _, group = make_group(tok, model, "What is 1 + 2?", 3, 0)
    flat = [t.model_copy(update={"reward": 1.0}) for t in group]
    assert build_batch([flat]).sequences == []
    failed = [t.model_copy(update={"status": "failed"}) for t in group[:9]] + group[9:]
    batch = build_batch([failed])
    assert batch.skipped_groups == 1 and batch.trajectories == 10


def test_staleness_is_measured_again_when_the_batch_is_built():
    """Accepted at lag <= 4, trained at version 9: the episode sampled at v3 is 6 versions old by now."""
    fresh = [Trajectory(id=f"f{i}", task_id="t", turns=[_turn([1, 2], [5, 6], [8, 9])], reward=i) for i in range(3)]
    old = Trajectory(id="old", task_id="t", turns=[_turn([1, 2], [7, 6], [3, 9])], reward=5.0)
    group = [*fresh, old]
    dropped = build_batch([group], version=9, max_staleness=4, stale_policy="drop")
    assert dropped.stale == 1 and len(dropped.sequences) == 3
    assert dropped.rewards == [0.0, 1.0, 2.0]  # normalised among the ones that are trained
    assert all(s.weights == [1.0, 1.0] for s in dropped.sequences)
    kept = build_batch([group], version=9, max_staleness=4, stale_policy="downweight")
    assert kept.stale == 0 and len(kept.sequences) == 4 and kept.downweighted == 1
    # the v3 token is 2 versions past the bound: a quarter of the weight; the v9 token is current
    assert kept.sequences[-1].weights == [0.25, 1.0] and kept.sequences[-1].versions == [3, 9]
    assert build_batch([group]).stale == 0  # no version given: nothing to measure against


def test_ppo_places_turn_rewards_and_the_episode_reward_on_tokens():
    """Two turns merged into one timeline: each turn's reward at its last token, the episode's at the end."""
    first = _turn([1, 2], [5, 6, 7], [0, 0, 0], reward=0.5)
    second = _turn([1, 2, 5, 6, 7, 3], [8, 9], [0, 0], reward=-0.25)
    other = _turn([4], [5], [0])  # a second agent: its own timeline, its own reward
    other = other.model_copy(update={"agent": "critic"})
    episode = Trajectory(id="e", task_id="t", turns=[first, second, other], reward=1.0, agent_rewards={"critic": 2.0})
    batch = build_batch([[episode]], algorithm="ppo")  # a group of one is trained: PPO needs no siblings
    [main, side] = batch.sequences
    assert main.positions == [2, 3, 4, 6, 7]
    assert main.rewards == [0.0, 0.0, 0.5, 0.0, -0.25 + 1.0]
    assert side.rewards == [2.0]
    assert batch.skipped_groups == 0 and main.advantages == [0.0] * 5  # the learner computes them (GAE)


def test_a_truncated_episode_counts_in_its_groups_baseline_and_trains_no_token():
    """--mask-truncated (DAPO's overlong filtering): the cut-off answer is not trained, and its reward still sets
    the others' baseline."""
    from agentjet_client.protocol import Trajectory
    from tests.server.learner.groups import _turn

    def episode(i: int, reward: float, finish: str) -> Trajectory:
        turn = _turn([1, 2, 3], [10 + i, 20 + i], [0, 0]).model_copy(update={"finish_reason": finish})
        return Trajectory(id=f"e{i}", task_id="t", turns=[turn], reward=reward)

    group = [episode(0, 1.0, "stop"), episode(1, 0.0, "length"), episode(2, 0.0, "stop"), episode(3, 1.0, "stop")]
    kept = build_batch([group])
    masked = build_batch([group], mask_truncated=True)
    assert len(kept.sequences) == 4 and kept.truncated == 0
    assert len(masked.sequences) == 3 and masked.truncated == 1
    assert [e.id for e in masked.included] == ["e0", "e2", "e3"]
    assert [s.advantages[0] for s in masked.sequences] == [kept.sequences[i].advantages[0] for i in (0, 2, 3)]


def test_overlong_shaping_costs_each_episode_its_costliest_turn_near_the_limit_and_each_agent_its_own():
    """DAPO's overlong reward shaping: nothing up to L_max - buffer, then linearly to the penalty at the limit;
    the advantages come from the shaped rewards, the batch reports the rewards as they were."""
    from agentjet_client.protocol import Trajectory
    from agentjet_server.learner.batch import overlong_shaped
    from tests.server.learner.groups import _turn

    def turn(length: int, limit: int | None, agent: str = "default") -> object:
        sampled = _turn([1, 2], list(range(10, 10 + length)), [0] * length)
        return sampled.model_copy(update={"max_tokens": limit, "agent": agent})

    def episode(i: int, turns: list, reward: float = 1.0, agents: dict[str, float] | None = None) -> Trajectory:
        return Trajectory(id=f"e{i}", task_id="t", turns=turns, reward=reward, agent_rewards=agents)

    limit, buffer, penalty = 16, 8, 0.5
    for length, cost in [(4, 0.0), (8, 0.0), (9, 0.5 / 8), (12, 0.25), (16, 0.5)]:
        shaped = overlong_shaped(episode(0, [turn(length, limit)]), buffer, penalty)
        assert shaped.reward == 1.0 - cost, (length, shaped.reward)
    # two turns: the costlier one counts; a turn without a known limit costs nothing
    two = overlong_shaped(episode(0, [turn(12, limit), turn(16, limit), turn(99, None)]), buffer, penalty)
    assert two.reward == 0.5
    # per agent: each agent's reward pays for its own turns
    team = episode(0, [turn(16, limit, "a"), turn(4, limit, "b")], agents={"a": 1.0, "b": 0.8})
    shaped_team = overlong_shaped(team, buffer, penalty)
    assert shaped_team.reward == 0.5 and shaped_team.agent_rewards == {"a": 0.5, "b": 0.8}
    group = [episode(i, [turn(length, limit)]) for i, length in enumerate([4, 12, 16])]  # all rewarded 1
    plain = build_batch([group])
    assert plain.sequences == []  # equal rewards: no signal
    batch = build_batch([group], overlong=(buffer, penalty))
    assert batch.rewards == [1.0, 1.0, 1.0] and len(batch.sequences) == 3
    advantages = [s.advantages[0] for s in batch.sequences]
    assert advantages[0] > advantages[1] > advantages[2]  # the longer, the lower (shaped 1, 0.75, 0.5)
