"""``agentjet-client try``: one episode shown as a transcript, pushed only when asked."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx2

ROOT = Path(__file__).resolve().parents[2]
CLIENT = str(Path(sys.executable).parent / "agentjet-client")


def tried(url: str, code: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    command = [CLIENT, "try", "--code-dir", str(code), "--server", url, *extra]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env={"COLUMNS": "200", "PATH": ""})


def counts(url: str) -> dict[str, int]:
    return httpx2.get(url + "/v1/status").json()["trajectories"]  # type: ignore[no-any-return]


def test_one_episode_is_shown_and_pushed_only_when_asked(live_server):
    before = counts(live_server.url)
    out = tried(live_server.url, ROOT / "examples" / "first_task", "--task", "spider")
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("── call 0  agent default  policy v") and "finish " in lines[0]
    assert lines[1] == "   user: 'Write the legs of a spider as a digit.'"
    assert lines[2].startswith("   -> answer: ") and lines[-1] in ("reward 1", "reward 0.1", "reward 0")
    assert counts(live_server.url) == before  # nothing pushed
    out = tried(live_server.url, ROOT / "examples" / "first_task", "--push")
    assert out.returncode == 0 and "pushed as an evaluation episode: accepted" in out.stdout, out.stdout + out.stderr
    after = counts(live_server.url)
    assert after["evaluated"] == before["evaluated"] + 1  # recorded by policy version, never trained


def test_a_failing_episode_shows_the_agents_own_traceback(live_server, tmp_path):
    (tmp_path / "agent.py").write_text(
        "from agentjet_client import swarm_agent\n\n\n"
        '@swarm_agent(tasks=[{"id": "t", "n": 3}])\n'
        "def divide(task, episode):\n"
        '    return 1 / (task["n"] - 3)\n'
    )
    out = tried(live_server.url, tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "failed: ZeroDivisionError: division by zero (agent.py:6 in divide)" in out.stdout
    assert f'File "{tmp_path / "agent.py"}", line 6, in divide' in out.stdout
    out = tried(live_server.url, tmp_path, "--task", "nope")
    assert out.returncode == 2 and "no task with id 'nope'" in out.stderr
