"""Multi-agent episodes: agents calling at the same time inside one episode get separate timelines,
each trained with its own agent's reward."""

from __future__ import annotations

import asyncio

import pytest

from agentjet_client import SwarmClient
from agentjet_client.run.report import coerce_reward
from agentjet_server.batching.timeline import build_timelines
from agentjet_server.learner.batch import build_batch


async def episode_of_two(client: SwarmClient, rewards: dict[str, float]):  # type: ignore[no-untyped-def]
    episode = client.episode("two-agents")
    planner, critic = episode.async_openai(agent="planner"), episode.async_openai(agent="critic")

    async def talk(llm, text: str, turns: int) -> None:  # type: ignore[no-untyped-def]
        messages = [{"role": "user", "content": text}]
        for _ in range(turns):
            reply = await llm.chat.completions.create(model="agentjet-tiny", messages=messages, max_tokens=6)
            messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""}]
            messages += [{"role": "user", "content": "Go on."}]

    await asyncio.gather(talk(planner, "Plan: write seven as a digit.", 3), talk(critic, "Check: seven.", 2))
    await episode.aclose()
    reward, per_agent = coerce_reward(rewards)
    return episode.to_trajectory(reward, agent_rewards=per_agent)


def test_concurrent_agents_get_separate_timelines_and_their_own_rewards(live_server):
    with SwarmClient(live_server.url) as client:

        async def group():  # type: ignore[no-untyped-def]
            try:
                return await asyncio.gather(
                    episode_of_two(client, {"planner": 1.0, "critic": 0.0}),
                    episode_of_two(client, {"planner": 0.0, "critic": 1.0}),
                )
            finally:
                await client.aclose_pool()  # the shared async pool belongs to this event loop

        trajectories = asyncio.run(group())
        assert [r.status for r in client.submit(list(trajectories)).results] == ["accepted", "accepted"]
    first = trajectories[0]
    assert sorted(t.agent for t in first.turns) == ["critic"] * 2 + ["planner"] * 3
    timelines = build_timelines(first.turns)
    assert sorted((t.agent, len(t.turns)) for t in timelines) == [("critic", 2), ("planner", 3)]  # interleaved calls
    assert first.reward == 0.5 and first.agent_rewards == {"planner": 1.0, "critic": 0.0}

    batch = build_batch([list(trajectories)])
    advantage_of = {}
    for trajectory in trajectories:
        for timeline in build_timelines(trajectory.turns):
            [seq] = [s for s in batch.sequences if s.tokens == timeline.tokens and s.positions == timeline.trained]
            assert len(set(seq.advantages)) == 1
            advantage_of[(trajectory.id, timeline.agent)] = round(seq.advantages[0], 4)
    a, b = (t.id for t in trajectories)
    # the episode rewards are equal (0.5 each), yet each agent has a signal of its own
    assert advantage_of[(a, "planner")] == 1.0 and advantage_of[(b, "planner")] == -1.0
    assert advantage_of[(a, "critic")] == -1.0 and advantage_of[(b, "critic")] == 1.0


def test_per_agent_rewards_must_be_numbers():
    assert coerce_reward({"a": 1, "b": 0.5}) == (0.75, {"a": 1.0, "b": 0.5})
    with pytest.raises(TypeError, match="per-agent rewards map agent names to numbers"):
        coerce_reward({"a": "high"})
    with pytest.raises(TypeError, match="must be finite"):
        coerce_reward({"a": float("nan")})
