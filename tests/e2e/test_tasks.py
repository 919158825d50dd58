"""Task sources end to end: a JSONL task file beside the agent with a held-out fraction, two epochs, the
client killed mid-epoch and restarted with the same spool. Checked on the server: every training task was
trained exactly epochs x group size times (nothing skipped, nothing repeated), every group is whole, and
no held-out task was ever trained."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx2
import pytest

from agentjet_client.delivery.spool import Spool, spool_key
from agentjet_client.tasks.sources import TaskSpec
from tests.conftest import ServerProcess, reap

pytestmark = pytest.mark.e2e

AGENT = """
import asyncio, random
from agentjet_client import swarm_agent

@swarm_agent(tasks="tasks.jsonl", eval_tasks=0.25)
async def say(task, episode):
    await asyncio.sleep(random.uniform(0.05, 0.6))  # a slow environment: a group's episodes end apart
    llm = episode.async_openai()
    reply = await llm.chat.completions.create(
        model="agentjet-tiny", messages=[{"role": "user", "content": task["prompt"]}], max_tokens=2
    )
    return float(len(reply.choices[0].message.content or "") % 2)
"""
EPOCHS, GROUP = 2, 4


def client(code: Path, url: str, spool_dir: Path) -> subprocess.Popen[str]:
    exe = str(Path(sys.executable).parent / "agentjet-client")
    command = [exe, "run", "--code-dir", str(code), "--server", url, "--epochs", str(EPOCHS), "--concurrency", "8"]
    command += ["--spool-dir", str(spool_dir), "--eval-every", "2", "--eval-episodes", "4"]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd="/")


def spooled(path: Path) -> int:
    if not (path / "spool.db").exists():
        return 0
    spool = Spool(path)
    try:
        return spool.stats().spooled
    finally:
        spool.close()


def test_a_task_file_with_a_held_out_part_trains_each_task_its_epochs_through_a_killed_client(model_dir, tmp_path):
    code = tmp_path / "agent"
    code.mkdir()
    (code / "agent.py").write_text(AGENT)
    rows = [{"id": f"w{i}", "prompt": f"Say the word number {i}."} for i in range(12)]
    (code / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = TaskSpec("tasks.jsonl", eval_tasks=0.25, base=code)
    train = {i for i, _ in spec.load()}
    held = {i for i, _ in spec.load(evaluation=True)}
    server = ServerProcess(["--batch-groups", "2", "--group-size", str(GROUP)], tmp_path / "server.log")
    spool_dir = tmp_path / "spool"
    first = second = None
    try:
        first = client(code, server.url, spool_dir)
        deadline = time.monotonic() + 120
        # a few groups in, mid-epoch, with a group part spooled (the episodes of a group end at different times)
        while (count := spooled(spool_dir / spool_key(server.url))) < 2 * GROUP or count % GROUP == 0:
            assert first.poll() is None, first.stdout.read() if first.stdout else ""
            assert time.monotonic() < deadline, "the client produced too little before the kill"
            time.sleep(0.05)
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        first.stdout.close()  # type: ignore[union-attr]
        second = client(code, server.url, spool_dir)
        out, _ = second.communicate(timeout=300)
        assert second.returncode == 0, out
        assert "groups a stopped run left open in the spool, then went on with its task order" in " ".join(out.split())
        server.wait_trained()
        listed = httpx2.get(f"{server.url}/v1/trajectories", params={"limit": 1000}, timeout=30).json()
    finally:
        for proc in (first, second):
            reap(proc)
        server.stop()
    trained = [t for t in listed["trajectories"] if t["purpose"] == "train"]
    evaluated = [t for t in listed["trajectories"] if t["purpose"] == "eval"]
    per_task = Counter(t["task_id"].split("@", 1)[0] for t in trained)
    per_group = Counter(t["task_id"] for t in trained)
    assert per_task == {task_id: EPOCHS * GROUP for task_id in train}, per_task  # none skipped, none repeated
    assert set(per_group.values()) == {GROUP}, per_group  # a group the kill cut was finished, not restarted
    clients: dict[str, set[str]] = {}
    for t in trained:
        clients.setdefault(t["task_id"], set()).add(t["client_id"])
    assert any(len(ids) == 2 for ids in clients.values()), "no group was cut by the kill"  # the case tested
    assert evaluated and {t["task_id"].split("@", 1)[0].removeprefix("eval:") for t in evaluated} <= held
    assert not held & set(per_task)


def test_run_env_plays_an_openenv_environment_without_a_code_dir(model_dir, tmp_path):
    """``run --env openenv:URL --tasks FILE --epochs 1``: the environment's agent with the file's tasks (reset
    arguments per task), each played once in groups, trained; a malformed --env says what it takes."""
    from tests.conftest import EXAMPLES_DIR, ExampleService

    rows = [{"id": f"echo-{w}", "reset": {"word": w}} for w in ("three", "eight")]
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = ExampleService(EXAMPLES_DIR / "openenv_echo" / "echo_env.py", probe="/health")
    server = ServerProcess(["--batch-groups", "1", "--group-size", "4"], tmp_path / "server.log")
    try:
        exe = str(Path(sys.executable).parent / "agentjet-client")
        command = [exe, "run", "--env", f"openenv:{env.base}", "--server", server.url, "--tasks", "tasks.jsonl"]
        command += ["--epochs", "2", "--spool-dir", str(tmp_path / "spool")]
        done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        status = server.wait_trained()
        bad = subprocess.run([exe, "run", "--env", "nothing", "--server", server.url], capture_output=True, text=True)
        neither = subprocess.run([exe, "run", "--server", server.url], capture_output=True, text=True)
    finally:
        server.stop()
        env.stop()
    assert "done: 16 episodes" in " ".join(done.stdout.split())  # 2 tasks x 2 epochs x groups of 4
    assert status["trajectories"]["accepted"] == 16 and status["trajectories"]["verified_turns"] == 32
    assert {t["task"] for t in status["tasks"]} == {"echo-three", "echo-eight"}
    assert bad.returncode == 2 and "give gymnasium:ENV_ID, openenv:URL or verifiers:MODULE" in " ".join(
        bad.stderr.split()
    )
    assert neither.returncode == 2 and "give --code-dir (your agent) or --env" in " ".join(neither.stderr.split())
