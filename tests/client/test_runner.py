"""The runner against a real server: groups, failures isolated to their episode, timeouts, reports."""

import asyncio

from agentjet_client import RunConfig, Runner, SwarmClient, swarm_agent
from agentjet_client.agent import SwarmAgent

ASK = [{"role": "user", "content": "Write four as a digit."}]


def make_agent() -> SwarmAgent:
    @swarm_agent(tasks=[{"id": "ok"}, {"id": "boom"}, {"id": "hang"}, {"id": "bad-reward"}])
    async def agent(task, episode):
        reply = await episode.async_openai().chat.completions.create(model="agentjet-tiny", messages=ASK, max_tokens=3)
        if task["id"] == "boom":
            raise ValueError("agent bug")
        if task["id"] == "hang":
            await asyncio.sleep(3600)
        if task["id"] == "bad-reward":
            return "yes"
        return float(reply.choices[0].message.content.strip() == "4")

    return agent


def test_runner_isolates_failures_and_times_out(live_server):
    with SwarmClient(live_server.url) as client:
        before = client.status().trajectories
        runner = Runner(client, make_agent(), RunConfig(episodes=8, group_size=2, concurrency=8, timeout=1.0, seed=0))
        report = asyncio.run(runner.run())
        after = client.status().trajectories
    assert report.finished == report.started == 8
    assert report.failed == 6 and len(report.rewards) == 2  # boom, hang, bad-reward fail; ok succeeds
    assert report.accepted == 8 and report.rejected == 0
    assert after.accepted - before.accepted == 8
    reasons = report.failure_reasons
    assert reasons["episode timed out after 1s"] == 2  # the hung episodes were abandoned, not awaited
    assert reasons["ValueError: agent bug"] == 2
    assert sum(n for r, n in reasons.items() if "agent returned 'yes'" in r) == 2


def test_sync_agents_run_in_threads(live_server):
    @swarm_agent(tasks=[{"id": "s"}])
    def sync_agent(task, episode):
        reply = episode.openai().chat.completions.create(model="agentjet-tiny", messages=ASK, max_tokens=3)
        return reply.choices[0].message.content.strip() == "4"

    with SwarmClient(live_server.url) as client:
        report = asyncio.run(Runner(client, sync_agent, RunConfig(episodes=4, group_size=2, concurrency=4)).run())
    assert report.finished == 4 and report.failed == 0 and report.accepted == 4
    assert all(r in (0.0, 1.0) for r in report.rewards)
