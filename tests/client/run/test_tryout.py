"""``agentjet-client try``: one episode shown as a transcript, pushed only when asked."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx2

ROOT = Path(__file__).resolve().parents[3]
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


RUBRIC_AGENT = """
from agentjet_client import Rubric, swarm_agent


def is_digit(result):
    return 1.0 if result.strip().isdigit() else 0.0


def short(result):
    return 0.5


@swarm_agent(tasks=[{"id": "t"}], reward=Rubric([(is_digit, 1.0), (short, 0.2)]))
def reply(task, episode):
    answer = episode.openai().chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Write three as a digit."}], max_tokens=3
    )
    return answer.choices[0].message.content or ""
"""


def test_an_agent_rewarded_by_a_rubric_shows_its_reward_and_each_score(live_server, tmp_path):
    (tmp_path / "agent.py").write_text(RUBRIC_AGENT)
    out = tried(live_server.url, tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    last = out.stdout.splitlines()[-1]
    assert last in ("reward 1.1 (is_digit 1, short 0.5)", "reward 0.1 (is_digit 0, short 0.5)"), out.stdout


def test_the_judged_example_is_tried_with_its_judge_and_a_judge_that_is_down_says_so(live_server):
    from tests.conftest import RulesJudge, free_port

    judge = RulesJudge("digits")
    try:
        env = {"AGENTJET_JUDGE_URL": judge.url, "AGENTJET_DIGITS": "3"}
        command = [CLIENT, "try", "--code-dir", str(ROOT / "examples" / "judged"), "--server", live_server.url]
        out = subprocess.run(command, capture_output=True, text=True, timeout=300, env={"COLUMNS": "200", **env})
        assert out.returncode == 0, out.stdout + out.stderr
        assert judge.calls() == 1
    finally:
        judge.stop()
    lines = out.stdout.splitlines()
    assert lines[-2].startswith("reward ") and lines[-2].endswith(")") and "(judge " in lines[-2], out.stdout
    assert lines[-1].startswith("   the judge said: "), out.stdout
    env["AGENTJET_JUDGE_URL"] = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    out = subprocess.run(command, capture_output=True, text=True, timeout=300, env={"COLUMNS": "200", **env})
    assert out.returncode == 1, out.stdout + out.stderr
    assert (
        "failed: the judge at http://127.0.0.1:" in out.stdout and "(the agent ran: its calls are above)" in out.stdout
    )


def test_an_agent_that_names_no_tasks_plays_those_given_on_the_command_line(live_server, tmp_path):
    (tmp_path / "agent.py").write_text(
        "from agentjet_client import swarm_agent\n\n\n"
        "@swarm_agent\n"
        "def echo(task, episode):\n"
        '    return float(task["id"] == "second")\n'
    )
    (tmp_path / "tasks.jsonl").write_text('{"id": "first"}\n{"id": "second"}\n')
    out = tried(live_server.url, tmp_path, "--tasks", str(tmp_path / "tasks.jsonl"), "--task", "second")
    assert out.returncode == 0 and out.stdout.splitlines()[-1] == "reward 1", out.stdout + out.stderr
    out = tried(live_server.url, tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    message = " ".join(out.stderr.split())
    assert "agent 'echo' names no tasks: give them on the command line (--tasks FILE)" in message, message
