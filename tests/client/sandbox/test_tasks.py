"""Terminal tasks in Harbor's format through the real sandbox: every shipped task scores 1 with its reference
solution and 0 when the agent does nothing; a task set read as a run's tasks; what the local backend refuses."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from agentjet_client.errors import TaskLoadError
from agentjet_client.sandbox import SandboxError, read_task, read_task_dirs, run_oracle, task_sandbox, verify
from agentjet_client.tasks.sources import TaskSpec

TASKS = Path(__file__).resolve().parents[3] / "examples" / "terminal_tasks"


def score(task_dir: Path, oracle: bool, root: Path) -> tuple[float, str]:
    async def body() -> tuple[float, str]:
        async with task_sandbox(read_task(task_dir), root) as (box, task):
            if oracle:
                assert (await run_oracle(box, task)).ok
            verdict = await verify(box, task)
            return verdict.reward, verdict.source

    return asyncio.run(body())


@pytest.mark.parametrize("name", ["count-words", "fix-greeting", "sum-numbers"])
def test_the_oracle_scores_1_and_doing_nothing_0(name: str, tmp_path: Path) -> None:
    source = {"count-words": "reward.json", "fix-greeting": "exit status", "sum-numbers": "reward.txt"}[name]
    assert score(TASKS / name, True, tmp_path) == (1.0, source)
    assert score(TASKS / name, False, tmp_path) == (0.0, source)
    assert not any(tmp_path.iterdir())  # every sandbox removed


def test_a_task_set_is_a_runs_task_source_with_its_limits() -> None:
    pairs = TaskSpec(str(TASKS)).load()
    assert [task_id for task_id, _ in pairs] == ["count-words", "fix-greeting", "sum-numbers"]
    _, first = pairs[0]
    assert first["instruction"].startswith("The directory /app/notes") and Path(first["task_dir"]).is_dir()
    tasks = {t.name: t for t in read_task_dirs(TASKS)}
    assert tasks["sum-numbers"].agent_timeout_s == 60.0 and tasks["sum-numbers"].memory_mb == 512
    assert tasks["count-words"].verifier_env == {"EXPECTED_FILES": "3"}
    assert tasks["fix-greeting"].metadata["category"] == "debugging"
    assert read_task_dirs(TASKS / "fix-greeting")[0].name == "fix-greeting"  # one task directory alone


def test_a_task_that_installs_what_the_host_lacks_is_refused_naming_it(tmp_path: Path) -> None:
    task = tmp_path / "needs-more"
    (task / "environment").mkdir(parents=True)
    (task / "tests").mkdir()
    (task / "instruction.md").write_text("Do it.")
    (task / "task.toml").write_text('version = "1.0"\n')
    (task / "tests" / "test.sh").write_text("exit 0\n")
    (task / "environment" / "Dockerfile").write_text(
        "FROM debian\nRUN apt-get update && \\\n    apt-get install -y bash no-such-package-xyz\n"
        "RUN pip install --no-cache-dir no_such_dist_abc==1.0\n"
    )

    async def body() -> None:
        async with task_sandbox(read_task(task), tmp_path / "boxes"):
            pass

    with pytest.raises(SandboxError, match=r"apt: no-such-package-xyz, pip: no_such_dist_abc"):
        asyncio.run(body())
    (task / "task.toml").write_text("[agent]\ntimeout_sec = 'soon'\n")
    with pytest.raises(TaskLoadError, match="not a number"):
        read_task(task)
    (task / "tests" / "test.sh").unlink()
    with pytest.raises(TaskLoadError, match=r"no tests/test\.sh"):
        read_task(task)
