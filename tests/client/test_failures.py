"""Failed episodes as a user meets them: the agent's own file and line with a trimmed traceback once, the
rest counted, a run that stops when its episodes keep failing (exit 3), tasks that fail to load, and a
group size that must match the server's."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import httpx2
import pytest

from agentjet_client.errors import TaskLoadError
from agentjet_client.failures import StopRule, describe

CLIENT = str(Path(sys.executable).parent / "agentjet-client")


def agent_dir(
    tmp_path: Path, body: str, tasks: str = 'return [{"id": f"t{i}", "word": "two"} for i in range(4)]'
) -> Path:
    code = tmp_path / "agent"
    code.mkdir()
    (code / "agent.py").write_text(
        textwrap.dedent(
            f"""\
            from agentjet_client import swarm_agent


            def tasks():
                {tasks}


            @swarm_agent(tasks=tasks)
            async def solve(task, episode):
                llm = episode.async_openai()
            """
        )
        + textwrap.indent(textwrap.dedent(body), "    ")
    )
    return code


def run(code: Path, url: str, *extra: str) -> subprocess.CompletedProcess[str]:
    command = [CLIENT, "run", "--code-dir", str(code), "--server", url, "--spool-dir", str(code.parent / "spool")]
    return subprocess.run([*command, *extra], capture_output=True, text=True, timeout=300)


def test_an_agent_with_a_typo_stops_the_run_naming_its_own_line(live_server, tmp_path):
    code = agent_dir(
        tmp_path,
        """\
        messages = [{"role": "user", "content": f"Write {task['wrod']} as a digit."}]
        reply = await llm.chat.completions.create(model="agentjet-tiny", messages=messages, max_tokens=2)
        return 1.0
        """,
    )
    out = run(code, live_server.url, "--episodes", "200")
    assert out.returncode == 3, out.stdout + out.stderr
    where = f"{code / 'agent.py'}"
    # the first failure in full, with only the agent's frames; the others counted, not repeated
    assert out.stderr.count("Traceback (the agent's own frames)") == 1, out.stderr
    assert f'File "{where}", line 11, in solve' in out.stderr and "site-packages" not in out.stderr
    assert "KeyError: 'wrod' (agent.py:11 in solve)" in out.stderr
    assert "the run stopped: every episode of the first group (2) failed" in out.stderr
    assert "failed: 2 x KeyError: 'wrod' (agent.py:11 in solve)" in out.stdout
    assert "no episode completed" in out.stdout and "nan" not in out.stdout


def test_an_agent_that_returns_nothing_says_so_and_a_failure_rate_bound_stops_it(live_server, tmp_path):
    code = agent_dir(
        tmp_path,
        """\
        messages = [{"role": "user", "content": "Write two as a digit."}]
        reply = await llm.chat.completions.create(model="agentjet-tiny", messages=messages, max_tokens=2)
        if task["id"] != "t0":
            return  # forgot the reward
        return 1.0
        """,
    )
    out = run(code, live_server.url, "--episodes", "200", "--max-failure-rate", "0.5")
    assert out.returncode == 3, out.stdout + out.stderr
    assert "more than --max-failure-rate 0.5" in out.stderr
    assert "the agent returned None; an agent must return its reward" in out.stdout
    assert "nan" not in out.stdout


def test_tasks_that_fail_to_load_say_where_in_the_agent(live_server, tmp_path):
    code = agent_dir(tmp_path, "return 1.0\n", tasks='return [{"id": i} for i in range(int("four"))]')
    out = run(code, live_server.url, "--episodes", "4")
    assert out.returncode == 2, out.stdout + out.stderr
    text = " ".join(out.stderr.split())
    assert "loading the tasks of agent 'solve' failed" in text and "line 5, in tasks" in text
    assert "ValueError: invalid literal for int() with base 10: 'four'" in text
    assert len(out.stderr.splitlines()) < 15  # the agent's frames, not the library's


def test_a_group_size_other_than_the_servers_is_refused_and_the_servers_is_the_default(live_server, tmp_path):
    code = agent_dir(
        tmp_path,
        """\
        messages = [{"role": "user", "content": "Write two as a digit."}]
        await llm.chat.completions.create(model="agentjet-tiny", messages=messages, max_tokens=2)
        return 1.0
        """,
    )
    size = httpx2.get(live_server.url + "/v1/status").json()["learner"]["group_size"]
    out = run(code, live_server.url, "--episodes", "4", "--group-size", str(size + 1))
    assert out.returncode == 2 and f"which trains groups of {size}" in " ".join(out.stderr.split()), out.stderr
    before = httpx2.get(live_server.url + "/v1/status").json()["trajectories"]["accepted"]
    out = run(code, live_server.url, "--episodes", str(2 * size))  # no --group-size: the server's
    assert out.returncode == 0, out.stdout + out.stderr
    assert httpx2.get(live_server.url + "/v1/status").json()["trajectories"]["accepted"] == before + 2 * size


def test_describe_keeps_the_agents_frames_only():
    def agent_code() -> None:
        import json

        json.loads("{not json")  # the failing line, inside the standard library

    try:
        agent_code()
    except ValueError as exc:
        failure = describe(exc)
    assert failure.line.startswith("json.decoder.JSONDecodeError: Expecting property name")
    line = agent_code.__code__.co_firstlineno + 3  # json.loads(...)
    assert failure.line.endswith(f"(test_failures.py:{line} in agent_code)")
    assert "json/decoder.py" not in failure.trace and "in agent_code" in failure.trace


@pytest.mark.parametrize(
    ("rule", "outcomes", "stops_at"),
    [
        (StopRule(group_size=2), [("a", True), ("b", False), ("a", True)], 3),  # the first group: all failed
        (StopRule(group_size=2), [("a", True), ("b", True), ("b", False), ("a", False)], None),  # not all
        (StopRule(group_size=4, episodes=40), [("a", True), ("b", True)], 2),  # the first 5% (2 of 40)
        (StopRule(group_size=2, max_rate=0.5), [("a", True), ("b", False), ("c", True)], 3),  # 2 of 3 > 0.5
        (StopRule(group_size=2, max_rate=1.0), [("a", True)] * 2 + [("b", True)] * 2, None),  # 1.0: never
    ],
)
def test_the_stop_rule(rule, outcomes, stops_at):
    reasons = [rule.record(group, failed) for group, failed in outcomes]
    stopped = next((i + 1 for i, reason in enumerate(reasons) if reason), None)
    assert stopped == stops_at, reasons


def test_a_task_file_opened_relative_to_where_run_starts_gets_the_way_to_open_it_beside_the_agent(
    tmp_path, monkeypatch
):
    import importlib.util

    code = tmp_path / "agent"
    code.mkdir()
    (code / "tasks.jsonl").write_text('{"id": "a"}\n')
    (code / "agent.py").write_text(
        textwrap.dedent(
            """\
            import json
            from agentjet_client import swarm_agent


            def tasks():
                with open("tasks.jsonl") as f:
                    return [json.loads(line) for line in f]


            @swarm_agent(tasks=tasks)
            def solve(task, episode):
                return 1.0
            """
        )
    )
    spec = importlib.util.spec_from_file_location("beside_agent", code / "agent.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.chdir(code)
    assert module.solve.load_tasks() == [("a", {"id": "a"})]  # started in the code dir: found
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TaskLoadError) as caught:
        module.solve.load_tasks()
    message = str(caught.value)
    assert "No such file or directory: 'tasks.jsonl'" in message
    assert f"tasks.jsonl is not in the directory `run` started in ({tmp_path})" in message
    assert f"beside the agent, in {code}" in message and "Path(__file__).parent / 'tasks.jsonl'" in message
    (code / "tasks.jsonl").unlink()  # a file that is nowhere gets no such advice
    with pytest.raises(TaskLoadError) as caught:
        module.solve.load_tasks()
    assert "beside the agent" not in str(caught.value)
