"""Code dirs with their own interpreter (``agentjet.toml``): what is refused and why, and episodes
run there (sync, async, hung, failing) against a real server."""

from __future__ import annotations

import asyncio
import venv

import pytest

from agentjet_client import RunConfig, Runner, SwarmClient
from agentjet_client.errors import AgentLoadError
from agentjet_client.run.tracks import RemoteWatcher, open_track, runtime_python

AGENT = """
import asyncio
import importlib.util

from agentjet_client import swarm_agent

assert importlib.util.find_spec("numpy") is None, "not in the second interpreter"


@swarm_agent(tasks=[{"id": "ok"}, {"id": "hang"}, {"id": "boom"}], eval_tasks=[{"id": "held-out"}], tag="remote")
async def remote(task, episode):
    reply = await episode.async_openai().chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "Write four as a digit."}], max_tokens=3
    )
    if task["id"] == "hang":
        await asyncio.sleep(10**6)  # a hung environment: only killing the worker ends it
    if task["id"] == "boom":
        raise ValueError("agent bug")
    return float(reply.choices[0].message.content.strip() == "4")
"""


def code_dir_with(tmp_path, source: str, toml: str):  # type: ignore[no-untyped-def]
    code = tmp_path / "agent"
    code.mkdir(exist_ok=True)
    (code / "agent.py").write_text(source)
    (code / "agentjet.toml").write_text(toml)
    return code


def test_runtime_file_mistakes_are_refused_with_what_to_do(tmp_path, client_only_python):
    code = code_dir_with(tmp_path, AGENT, 'pyhton = "x"\n')
    with pytest.raises(AgentLoadError, match=r"unknown keys \['pyhton'\]; the keys it may hold are \['python'\]"):
        runtime_python(code)
    (code / "agentjet.toml").write_text('python = "./no/such/python"\n')
    with pytest.raises(AgentLoadError, match="which does not exist; give the path"):
        open_track(code, concurrency=1)
    (code / "agentjet.toml").write_text("python = [1]\n")
    with pytest.raises(AgentLoadError, match="python must be a path or command"):
        runtime_python(code)
    bare = tmp_path / "bare"
    venv.EnvBuilder(with_pip=False).create(bare)  # an interpreter without agentjet-client
    (code / "agentjet.toml").write_text(f'python = "{bare / "bin" / "python"}"\n')
    with pytest.raises(AgentLoadError, match=r"cannot import agentjet_client .*-m pip install agentjet-client"):
        open_track(code, concurrency=1)
    # the code does not import there
    (code / "agentjet.toml").write_text(f'python = "{client_only_python}"\n')
    (code / "agent.py").write_text("import numpy\n" + AGENT)
    with pytest.raises(AgentLoadError, match=f"No module named 'numpy'.*in {client_only_python}"):
        open_track(code, concurrency=1)
    # tasks that only that interpreter can read
    (code / "agent.py").write_text(
        "from agentjet_client import swarm_agent\n"
        "class Box:\n    pass\n"
        "@swarm_agent(tasks=lambda: [{'id': 'x', 'box': Box()}])\n"
        "def agent(task, episode):\n    return 1.0\n"
    )
    track = open_track(code, concurrency=1)
    with pytest.raises(AgentLoadError, match="must be plain data"):
        track.agent.load_tasks()
    (code / "agent.py").write_text(
        "from agentjet_client import swarm_agent\n@swarm_agent(tasks=[])\ndef agent(task, episode):\n    return 1.0\n"
    )
    with pytest.raises(ValueError, match="has no tasks"):
        open_track(code, concurrency=1).agent.load_tasks()


def test_episodes_run_in_the_code_dirs_interpreter(live_server, tmp_path, client_only_python):
    code = code_dir_with(tmp_path, AGENT, f'python = "{client_only_python}"\n')
    track = open_track(code, concurrency=3)
    assert track.remote and track.tag == "remote" and track.agent.is_async
    assert [task_id for task_id, _ in track.agent.load_tasks(evaluation=True)] == ["held-out"]
    assert track.workers is not None and track.workers.python == str(client_only_python)
    with SwarmClient(live_server.url) as client:
        before = client.status().trajectories.accepted
        config = RunConfig(episodes=12, group_size=2, concurrency=3, timeout=3.0, seed=1)
        report = asyncio.run(Runner(client, [track], config).run())
        after = client.status().trajectories.accepted
    assert report.finished == 12 and after - before == 12
    reasons = report.failure_reasons
    hung = reasons["episode timed out after 3s (--timeout)"]
    assert hung >= 2 and sum(n for r, n in reasons.items() if r.startswith("ValueError: agent bug (agent.py:")) >= 2, (
        reasons
    )
    assert len(report.rewards) == 12 - report.failed >= 2  # the ok ones completed with their captured turns
    assert report.turns_by_agent["default"] == 12  # each episode's call (before its hang or bug) was captured
    assert track.workers.killed == hung and track.workers.live == 0
    assert report.tag_rewards.keys() == {"remote"} and report.episodes_by_tag == {"remote": 12}


def test_an_edit_is_taken_once_it_imports_in_the_code_dirs_interpreter(tmp_path, client_only_python):
    code = code_dir_with(tmp_path, AGENT, f'python = "{client_only_python}"\n')
    track = open_track(code, concurrency=1)
    watcher = track.watcher
    assert isinstance(watcher, RemoteWatcher) and watcher.poll() is None  # nothing changed
    (code / "agent.py").write_text("import numpy\n" + AGENT)  # does not import there
    assert watcher.poll() is None and "No module named 'numpy'" in (watcher.last_error or "")
    assert watcher.failed_version is not None  # remembered: not tried again until the next edit
    (code / "agent.py").write_text(AGENT.replace('tag="remote"', 'tag="edited"'))
    swapped = watcher.poll()
    assert swapped is not None and swapped[0].tag == "edited" and swapped[1] == watcher.version != track.code_version
    assert watcher.last_error is None
