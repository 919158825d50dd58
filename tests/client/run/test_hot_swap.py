"""Hot swap: an edit to the agent's code reaches new episodes during a run; a broken edit does not stop it."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

from agentjet_client import RunConfig, Runner, SwarmClient
from agentjet_client.run.loader import CodeWatcher, load_agent

AGENT = """
from agentjet_client import swarm_agent
from helper import REWARD

@swarm_agent(tasks=[{{"id": "swap"}}])
async def agent(task, episode):
    await episode.async_openai().chat.completions.create(
        model="agentjet-tiny", messages=[{{"role": "user", "content": "hi"}}], max_tokens=2
    )
    return {reward}
"""


def write(code_dir: Path, agent_reward: str, helper_reward: float) -> None:
    (code_dir / "helper.py").write_text(f"REWARD = {helper_reward}\n")
    (code_dir / "agent.py").write_text(AGENT.format(reward=agent_reward))


def wait_for(predicate, limit: float = 60.0) -> None:
    deadline = time.monotonic() + limit
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_edits_reach_new_episodes_and_a_broken_edit_keeps_the_old_code(live_server, tmp_path):
    code_dir = tmp_path / "agent"
    code_dir.mkdir()
    write(code_dir, "REWARD", 0.25)  # reward from a sibling module: its edits must count too
    agent, first = load_agent(code_dir)
    config = RunConfig(group_size=2, concurrency=2, watch_interval=0.1, timeout=30)
    with SwarmClient(live_server.url) as client:
        runner = Runner(client, agent, config, code_version=first, watcher=CodeWatcher(code_dir, first))
        done = threading.Event()
        thread = threading.Thread(target=lambda: (asyncio.run(runner.run()), done.set()))
        thread.start()
        try:
            wait_for(lambda: runner.report.code_versions[first] >= 4)
            write(code_dir, "REWARD", 0.75)  # edit the helper only
            wait_for(lambda: len(runner.report.reloads) == 1)
            second = runner.report.reloads[0]
            wait_for(lambda: runner.report.code_versions[second] >= 4)
            (code_dir / "agent.py").write_text("this is not python\n")
            wait_for(lambda: len(runner.report.reload_errors) == 1)
            count = runner.report.finished
            wait_for(lambda: runner.report.finished >= count + 4)  # still running, on the second code
        finally:
            runner.stop()
            thread.join(timeout=60)
    report = runner.report
    assert done.is_set() and second != first
    assert set(report.code_versions) == {first, second}
    assert "importing" in report.reload_errors[0] and "agent.py" in report.reload_errors[0]
    # behaviour follows the code each episode started with, including episodes in flight at the edit
    assert set(report.rewards_by_version[first]) == {0.25} and set(report.rewards_by_version[second]) == {0.75}
    assert report.rewards[-4:] == [0.75] * 4
