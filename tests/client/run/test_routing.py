"""Agents on different servers: routing by agent name, episodes split by server, delivery per server."""

from __future__ import annotations

import asyncio
import time

import httpx2
import pytest

from agentjet_client import RunConfig, Runner, Spool, SwarmClient, swarm_agent
from agentjet_client.protocol import check_agent_name
from tests.conftest import LiveServer, free_port

ASK = [{"role": "user", "content": "Write four as a digit."}]
COPY = [{"role": "user", "content": "Repeat the digit 7."}]


@pytest.fixture(scope="module")
def pair(model_dir):
    """Two servers of their own (own keys, own learners): the planner's and the executor's."""
    planner = LiveServer(model_dir, batch_groups=1, group_size=2)
    executor = LiveServer(model_dir, name="executor-model", batch_groups=1, group_size=2)
    yield planner, executor
    planner.stop()
    executor.stop()


def test_each_agent_samples_from_its_server_whatever_model_name_its_code_asks_for(pair):
    planner, executor = pair
    with SwarmClient(planner.url, agents={"executor": executor.url}) as client:
        before = [client.status(s.url).trajectories.accepted for s in pair]
        with client.episode("route-1") as episode:
            episode.openai().chat.completions.create(model="gpt-4o-mini", messages=ASK, max_tokens=3)
            episode.openai(agent="executor").chat.completions.create(model="gpt-4o-mini", messages=COPY, max_tokens=3)
            # any program through the capture proxy: the path names the agent, the agent names the server
            answer = httpx2.post(
                episode.url_for("executor") + "/chat/completions",
                json={"model": "anything", "messages": COPY, "max_tokens": 3},
            )
            assert answer.status_code == 200 and answer.json()["model"] == "executor-model"
            trajectory = episode.to_trajectory(1.0, agent_rewards={"default": 1.0, "executor": 0.0})
        turns = trajectory.turns
        assert [(t.agent, t.model) for t in turns] == [
            ("default", "agentjet-tiny"),
            ("executor", "executor-model"),
            ("executor", "executor-model"),
        ]
        assert [t.requested_model for t in turns] == ["gpt-4o-mini", "gpt-4o-mini", "anything"]
        parts = client.split(trajectory)
        assert [t.agent for t in parts[planner.url].turns] == ["default"]
        assert [t.agent for t in parts[executor.url].turns] == ["executor", "executor"]
        for part in parts.values():
            assert part.id == trajectory.id and part.reward == 1.0
            assert part.agent_rewards == {"default": 1.0, "executor": 0.0}
        result = client.submit([trajectory])  # each part to its own server
        assert [r.status for r in result.results] == ["accepted"]
        after = [client.status(s.url).trajectories.accepted for s in pair]
        assert [a - b for a, b in zip(after, before, strict=True)] == [1, 1]
        # a turn pushed to the server that did not sample it is rejected, not trained
        misrouted = parts[executor.url].model_copy(update={"id": "misrouted-1"})
        wrong = client.submit_to(planner.url, [misrouted])
        assert wrong.results[0].status == "rejected" and "not what this server sampled" in wrong.results[0].reason
        # an episode that made no call to the executor: its server still gets its part (so that
        # server's GRPO group completes), marked failed since there is nothing to train there
        with client.episode("route-1") as episode:
            episode.openai().chat.completions.create(model="gpt-4o-mini", messages=ASK, max_tokens=3)
            planner_only = episode.to_trajectory(0.0)
        idle = client.split(planner_only)[executor.url]
        assert idle.status == "failed" and idle.turns == [] and "no call to this server" in idle.error
        assert [r.status for r in client.submit([planner_only]).results] == ["accepted"]
    # without the routing, the server still names what it serves
    reply = httpx2.post(planner.url + "/v1/chat/completions", json={"model": "gpt-4o-mini", "messages": ASK})
    assert reply.status_code == 400 and "not served here" in reply.text


def test_both_episodes_an_agent_can_get_fulfil_the_episode_contract(pair):
    from agentjet_client import EpisodeHandle
    from agentjet_client.run.isolation import ProxyEpisode

    with SwarmClient(pair[0].url) as client, client.episode("contract") as episode:
        assert isinstance(episode, EpisodeHandle)
        worker_side = ProxyEpisode(episode.id, "contract", episode.base_url.split("/episodes/")[0], "key")
        assert isinstance(worker_side, EpisodeHandle)
        assert worker_side.url_for("executor") == episode.url_for("executor")
        with pytest.raises(ValueError, match="agent name"):
            worker_side.url_for("a/b")


def test_routes_are_checked():
    with pytest.raises(ValueError, match="agent name"):
        SwarmClient("http://127.0.0.1:1", agents={"bad/name": "http://127.0.0.1:2"})
    with pytest.raises(ValueError, match="must start with http"):
        SwarmClient("http://127.0.0.1:1", agents={"executor": "127.0.0.1:2"})
    assert check_agent_name("planner-2.v1_x") == "planner-2.v1_x"


def team():
    @swarm_agent(tasks=[{"id": "a"}, {"id": "b"}])
    async def agent(task, episode):
        plan = await episode.async_openai(agent="planner").chat.completions.create(
            model="gpt-4o-mini", messages=ASK, max_tokens=3
        )
        done = await episode.async_openai(agent="executor").chat.completions.create(
            model="gpt-4o-mini", messages=COPY, max_tokens=3
        )
        return {
            "planner": float(plan.choices[0].message.content.strip() == "4"),
            "executor": float(done.choices[0].message.content.strip() == "7"),
        }

    return agent


def test_runner_delivers_each_servers_part_and_one_server_down_holds_back_only_its_own(model_dir, tmp_path):
    planner = LiveServer(model_dir, batch_groups=1, group_size=2)
    executor_port = free_port()
    executor = None
    spools = {planner.url: Spool(tmp_path / "p"), f"http://127.0.0.1:{executor_port}": Spool(tmp_path / "e")}
    try:
        with SwarmClient(planner.url, agents={"executor": f"http://127.0.0.1:{executor_port}"}) as client:
            client.status()
            # the executor's server is not up: its calls fail, so each episode fails, but the planner's
            # server still gets (and answers) its part of every one, while the executor's parts wait
            config = RunConfig(episodes=4, group_size=2, concurrency=4, admission=False, backoff_max=0.5, timeout=20)
            runner = Runner(client, team(), config, spools=spools)

            async def until_planner_answered() -> None:
                job = asyncio.create_task(runner.run())
                deadline = time.monotonic() + 120
                while runner.report.by_server.get(planner.url, {}).get("accepted", 0) < 4:
                    assert time.monotonic() < deadline and not job.done()
                    await asyncio.sleep(0.1)
                runner.stop()
                await job

            asyncio.run(until_planner_answered())
        assert runner.report.finished == 4
        assert spools[f"http://127.0.0.1:{executor_port}"].depth == 4  # kept, not lost
        assert spools[planner.url].depth == 0

        executor = LiveServer(model_dir, port=executor_port, name="executor-model", batch_groups=1, group_size=2)
        with SwarmClient(planner.url, agents={"executor": executor.url}) as client:
            config = RunConfig(episodes=8, group_size=2, concurrency=8, timeout=60)
            runner = Runner(client, team(), config, spools=spools)
            report = asyncio.run(runner.run())
            counts = {s.url: client.status(s.url).trajectories for s in (planner, executor)}
        assert report.finished == 8 and report.failed == 0
        assert report.resent_leftovers == 4  # the executor's parts from the first run
        assert report.by_server[planner.url]["accepted"] == 8
        assert report.by_server[executor.url]["accepted"] == 12  # with the 4 left over
        assert counts[planner.url].accepted == 12 and counts[executor.url].accepted == 12
        assert all(s.depth == 0 for s in spools.values())
    finally:
        planner.stop()
        if executor is not None:
            executor.stop()
        for spool in spools.values():
            spool.close()


def test_server_flags_name_each_agents_server():
    from agentjet_client.run.session import parse_servers

    assert parse_servers([]) == ("http://127.0.0.1:8000", {})
    assert parse_servers(["http://h:1/v1?x=1", "executor=http://h:2", "critic=https://h:3/a=b"]) == (
        "http://h:1/v1?x=1",
        {"executor": "http://h:2", "critic": "https://h:3/a=b"},
    )
    assert parse_servers(["executor=http://h:2"]) == ("http://127.0.0.1:8000", {"executor": "http://h:2"})
    with pytest.raises(ValueError, match="default server is already"):
        parse_servers(["http://h:1", "http://h:2"])
    with pytest.raises(ValueError, match="already has a server"):
        parse_servers(["e=http://h:1", "e=http://h:2"])
