"""Sync agents in worker processes: a blocking hang is abandoned at the timeout by killing its worker,
the pool keeps its size, and calls made in a worker are still captured."""

from __future__ import annotations

import asyncio
import threading

from agentjet_client import RunConfig, Runner, SwarmClient
from agentjet_client.isolation import WorkerPool
from agentjet_client.loader import load_agent
from agentjet_server.app import WORKER_THREADS

AGENT = """
import time
from agentjet_client import swarm_agent

@swarm_agent(tasks=[{"id": "ok"}, {"id": "hang"}, {"id": "boom"}])
def agent(task, episode):
    reply = episode.openai().chat.completions.create(
        model="agentjet-tiny", messages=[{"role": "user", "content": "Write four as a digit."}], max_tokens=3
    )
    if task["id"] == "hang":
        time.sleep(10**6)  # a blocking call no thread could be pulled out of
    if task["id"] == "boom":
        raise ValueError("agent bug")
    return float(reply.choices[0].message.content.strip() == "4")
"""


def client_threads() -> int:
    """Threads of this process but the in-process server's workers (which its event loop keeps)."""
    return sum(1 for t in threading.enumerate() if not t.name.startswith(WORKER_THREADS))


def test_hung_sync_agents_are_killed_and_replaced_and_calls_are_captured(live_server, tmp_path):
    code_dir = tmp_path / "agent"
    code_dir.mkdir()
    (code_dir / "agent.py").write_text(AGENT)
    agent, version = load_agent(code_dir)
    assert not agent.is_async
    pool = WorkerPool(code_dir, size=3)
    threads_before = client_threads()
    with SwarmClient(live_server.url) as client:
        before = client.status().trajectories.accepted
        config = RunConfig(episodes=18, group_size=2, concurrency=3, timeout=2.0, seed=1)
        report = asyncio.run(Runner(client, agent, config, code_version=version, workers=pool).run())
        after = client.status().trajectories.accepted
    assert report.finished == 18 and after - before == 18
    reasons = report.failure_reasons
    hung = reasons["episode timed out after 2s (--timeout)"]
    assert hung >= 2 and sum(n for r, n in reasons.items() if r.startswith("ValueError: agent bug (agent.py:")) >= 2
    assert len(report.rewards) == 18 - report.failed >= 2  # the ok episodes completed, with captured turns
    assert pool.killed == hung and pool.started <= 3 + 1 + hung and pool.live == 0
    assert pool.peak <= 3 + 1  # the pool's size plus one warm spare, however many hung
    assert client_threads() <= threads_before + 1  # nothing left behind (the proxy may still run)
    assert report.code_versions == {version: 18}
