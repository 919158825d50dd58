"""Sync agents in worker processes: a blocking hang is abandoned at the timeout by killing its worker,
the pool keeps its size, and calls made in a worker are still captured."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

from agentjet_client import RunConfig, Runner, SwarmClient
from agentjet_client.run.isolation import WorkerPool
from agentjet_client.run.loader import load_agent
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


SDK_AGENT = """
import json, os, sys
from agentjet_client import swarm_agent

@swarm_agent(tasks=[{"id": "a"}])
def agent(task, episode):
    # what this worker had imported before the episode: the fork server's preload, nothing of its own
    names = ("anthropic", "langchain_openai", "agentjet_client.capture.adapters.anthropic")
    seen = sorted(name for name in names if name in sys.modules)
    with open(os.path.join(os.environ["SEEN_DIR"], f"{os.getpid()}.json"), "w") as out:
        json.dump(seen, out)
    if task["id"] == "never":
        import anthropic  # imported here only: the worker never runs this line
        return float(anthropic.__version__ == "")
    return 1.0
"""


def test_sdk_imports_reads_what_the_code_dir_imports_and_has_the_episode_import(tmp_path):
    from agentjet_client.run.isolation import sdk_imports

    (tmp_path / "agent.py").write_text(
        "import json\nfrom agentjet_client import swarm_agent\nimport helpers\n"
        "def run(task, episode):\n    from langchain_core.messages import HumanMessage\n"
        "    llm = episode.anthropic()\n    return episode.agentscope()\n"
    )
    (tmp_path / "helpers.py").write_text("import agents  # the code dir's own module named like the SDK\n")
    (tmp_path / "agents.py").write_text("")
    (tmp_path / "broken.py").write_text("def (:\n")  # the worker's own import reports it; the scan skips it
    assert sdk_imports(tmp_path) == [
        "agentjet_client.capture.adapters.agentscope",
        "agentjet_client.capture.adapters.anthropic",
        "agentscope.credential",
        "agentscope.model",
        "anthropic",
        "langchain_core.messages",
    ]
    assert sdk_imports(tmp_path / "missing") == []


def test_workers_fork_with_the_agents_sdk_already_imported(live_server, tmp_path):
    """The fork server imports the SDK the agent's code imports (inside a function it never calls
    here), so every worker starts with it instead of importing it again."""
    code_dir, seen = tmp_path / "agent", tmp_path / "seen"
    code_dir.mkdir()
    seen.mkdir()
    (code_dir / "agent.py").write_text(SDK_AGENT)
    command = [str(Path(sys.executable).parent / "agentjet-client"), "run", "--code-dir", str(code_dir)]
    command += ["--server", live_server.url, "--episodes", "4", "--group-size", "2", "--concurrency", "2"]
    command += ["--spool-dir", str(tmp_path / "spool")]
    run = subprocess.run(
        command, env={**os.environ, "SEEN_DIR": str(seen)}, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stdout + run.stderr
    reports = [json.loads(path.read_text()) for path in seen.glob("*.json")]
    assert reports and all(report == ["anthropic"] for report in reports), reports
