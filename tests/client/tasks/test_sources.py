"""Task sources: files and saved datasets read as task dicts, relative to the agent, and held-out tasks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentjet_client.errors import TaskLoadError
from agentjet_client.tasks.sources import TaskSpec, held_out

ROWS = [{"id": f"q{i}", "question": f"what is {i}+{i}?", "answer": str(2 * i)} for i in range(20)]


def write_jsonl(path: Path, rows: list[dict[str, str]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_jsonl_json_csv_and_parquet_files_give_the_same_tasks(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    write_jsonl(tmp_path / "t.jsonl", ROWS)
    (tmp_path / "t.json").write_text(json.dumps(ROWS))
    (tmp_path / "t.csv").write_text(
        "id,question,answer\n" + "".join(f"{r['id']},{r['question']},{r['answer']}\n" for r in ROWS)
    )
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "t.parquet")
    for name in ("t.jsonl", "t.json", "t.csv", "t.parquet"):
        pairs = TaskSpec(name, base=tmp_path).load()
        assert pairs == [(row["id"], row) for row in ROWS], name


def test_a_saved_datasets_directory_loads_a_dataset_and_a_named_split(tmp_path):
    import datasets

    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "flat"))
    assert [t for _, t in TaskSpec("flat", base=tmp_path).load()] == ROWS
    both = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS[:15]), "test": datasets.Dataset.from_list(ROWS[15:])}
    )
    both.save_to_disk(str(tmp_path / "split"))
    spec = TaskSpec("split", eval_tasks="test", split="train", base=tmp_path)
    assert [i for i, _ in spec.load()] == [r["id"] for r in ROWS[:15]]
    assert [i for i, _ in spec.load(evaluation=True)] == [r["id"] for r in ROWS[15:]]
    with pytest.raises(TaskLoadError, match="holds the splits test, train; name the one to train on"):
        TaskSpec("split", base=tmp_path).load()
    with pytest.raises(TaskLoadError, match="has no split 'dev'; its splits are test, train"):
        TaskSpec("split", split="dev", base=tmp_path).load()


def test_a_fraction_holds_out_the_same_tasks_whatever_the_files_order(tmp_path):
    spec = TaskSpec(write_jsonl(tmp_path / "a.jsonl", ROWS).name, eval_tasks=0.2, base=tmp_path)
    train, held = spec.load(), spec.load(evaluation=True)
    assert 1 <= len(held) <= 8 and len(train) + len(held) == 20
    assert not {i for i, _ in train} & {i for i, _ in held}
    shuffled = TaskSpec(write_jsonl(tmp_path / "b.jsonl", ROWS[::-1]).name, eval_tasks=0.2, base=tmp_path)
    assert {i for i, _ in shuffled.load(evaluation=True)} == {i for i, _ in held}
    # as the file grows no task crosses over: the old held-out ones stay held out, the trained stay trained
    ids = [r["id"] for r in ROWS]
    grown = held_out(ids + [f"new{i}" for i in range(2000)], 0.2)
    assert grown & set(ids) == {i for i, _ in held}
    assert 0.17 < len(grown) / 2020 < 0.23  # about the share asked for
    assert held_out(["a", "b"], 0.01) and len(held_out(["a", "b"], 0.99)) == 1  # one each side at least


def test_relative_paths_are_read_beside_the_agent_wherever_run_starts(tmp_path, monkeypatch):
    code = tmp_path / "agent_dir"
    code.mkdir()
    write_jsonl(code / "tasks.jsonl", ROWS[:3])
    (code / "agent.py").write_text(
        "from agentjet_client import swarm_agent\n"
        "@swarm_agent(tasks='tasks.jsonl', eval_tasks='held.jsonl')\n"
        "def solve(task, episode):\n    return 1.0\n"
    )
    write_jsonl(code / "held.jsonl", ROWS[3:5])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    from agentjet_client.run.loader import load_agent

    agent, _ = load_agent(code)
    assert [i for i, _ in agent.load_tasks()] == ["q0", "q1", "q2"]
    assert [i for i, _ in agent.load_tasks(evaluation=True)] == ["q3", "q4"]


def test_unreadable_sources_say_what_is_wrong_and_how_to_fix_it(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"id": "a"}\n{"id": \n')
    cases = {
        "bad.jsonl": "bad.jsonl, line 2: not JSON",
        "missing.jsonl": "missing.jsonl does not exist",
        "notes.txt": "tasks are read from .jsonl, .ndjson, .json, .csv, .parquet",
    }
    (tmp_path / "notes.txt").write_text("x")
    for name, message in cases.items():
        with pytest.raises(TaskLoadError, match=message):
            TaskSpec(name, base=tmp_path).load()
    write_jsonl(tmp_path / "ok.jsonl", ROWS)
    with pytest.raises(TaskLoadError, match=r"hold out evaluation tasks with eval_tasks=0\.1"):
        TaskSpec("ok.jsonl", split="test", base=tmp_path).load()
    (tmp_path / "list.jsonl").write_text('["not", "a", "dict"]\n')
    with pytest.raises(ValueError, match="task 0 of the agent is a list; tasks must be dicts"):
        TaskSpec("list.jsonl", base=tmp_path).load()
    with pytest.raises(ValueError, match="a fraction of the tasks to hold out is a number between 0 and 1"):
        TaskSpec("ok.jsonl", eval_tasks=1.5)
    with pytest.raises(
        ValueError, match=r"has no evaluation tasks; give held-out tasks on the command line \(--eval-tasks"
    ):
        TaskSpec("ok.jsonl", base=tmp_path).load(evaluation=True)


def test_run_takes_a_saved_dataset_and_its_splits_from_the_command_line_and_ends_after_its_epochs(
    live_server, tmp_path
):
    """``run --tasks DIR --split train --eval-tasks test --epochs 1`` on an agent whose own tasks are a list:
    the dataset's training split is played once (one group of 2 per task) and the run ends by itself;
    the evaluation rounds play the test split."""
    import subprocess
    import sys

    import datasets

    data = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS[:5]), "test": datasets.Dataset.from_list(ROWS[5:8])}
    )
    data.save_to_disk(str(tmp_path / "data"))
    code = tmp_path / "code"
    code.mkdir()
    (code / "agent.py").write_text(
        "from agentjet_client import swarm_agent\n"
        "@swarm_agent(tasks=[{'id': 'not-these'}])\n"
        "async def solve(task, episode):\n"
        "    assert task['id'] != 'not-these'\n"
        "    reply = await episode.async_openai().chat.completions.create(\n"
        "        model='agentjet-tiny', messages=[{'role': 'user', 'content': task['question']}], max_tokens=2)\n"
        "    return 1.0\n"
    )
    exe = str(Path(sys.executable).parent / "agentjet-client")
    command = [exe, "run", "--code-dir", str(code), "--server", live_server.url, "--tasks", "data", "--split", "train"]
    command += ["--eval-tasks", "test", "--epochs", "1", "--eval-every", "1000", "--spool-dir", str(tmp_path / "s")]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = " ".join(done.stdout.split())
    assert "done: 10 episodes" in summary, summary  # 5 training tasks x groups of 2, then the run ended
    assert "failed 0" in summary and "v0: 1.000 (3)" in summary  # an evaluation round: the 3 held-out tasks
    bad = subprocess.run([*command[:-2], "--split", "dev"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "has no split 'dev'; its splits are test, train" in " ".join(bad.stderr.split())


def test_two_tasks_with_one_id_are_refused_not_merged(tmp_path):
    write_jsonl(tmp_path / "dup.jsonl", [{"id": "a", "q": 1}, {"id": "b", "q": 2}, {"id": "a", "q": 3}])
    with pytest.raises(ValueError, match=r"tasks 0 and 2 of the tasks of the agent have the same id 'a'; give each"):
        TaskSpec("dup.jsonl", base=tmp_path).load()
    assert [i for i, _ in TaskSpec([{"q": 1}, {"q": 2}]).load()] == ["task-0", "task-1"]  # numbered when left out
