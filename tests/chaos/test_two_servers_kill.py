"""Fault injection across servers: three client runs feed two servers; one server is SIGKILLed
mid-run and restarted with ``--resume``.

Server A hosts the planner's model, server B the executor's. Run 1 is a team
(``examples/planner_executor``: planner on A, executor on B), run 2 an agent on A alone, run 3 an
agent on B alone: A takes parts from runs 1 and 2, B from runs 1 and 3 (many clients x many servers).
B is killed once it has checkpointed. Counted per server at the end: produced (parts the clients
committed to their spools for that server), answered (removed from the spools once the server
answered), the ids in the server's trajectory log (each exactly once) and lost = produced - logged,
which must be 0 on both. While B is down, A keeps taking episodes (run 2 never needed B): its
accepted episodes per second during the outage are reported next to its rate before.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from agentjet_client.delivery.spool import spool_key
from agentjet_server.ingest.wal import TrajectoryLog
from tests.chaos.test_client_kill import spool_stats
from tests.chaos.test_server_kill import latest_checkpoint
from tests.conftest import ServerProcess, free_port, reap

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]

SOLO = """
import asyncio

from agentjet_client import swarm_agent

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


@swarm_agent(tasks=[{"id": f"digit-{d}", "word": WORDS[d], "answer": str(d)} for d in (3, 8)])
async def solo(task, episode):
    await asyncio.sleep(0.2)  # an environment that takes a while: the run spans the outage
    reply = await episode.async_openai().chat.completions.create(
        model="agentjet-tiny", messages=[{"role": "user", "content": f"Write {task['word']} as a digit."}], max_tokens=4
    )
    return 1.0 if (reply.choices[0].message.content or "").strip() == task["answer"] else 0.0
"""


def accepted(server: ServerProcess) -> int:
    return int(server.status()["trajectories"]["accepted"])


def settled(server: ServerProcess, batch: int = 16, limit: float = 180) -> dict:  # type: ignore[type-arg]
    """The status once the learner has trained every full batch (stale answers can leave a part batch)."""
    deadline = time.monotonic() + limit
    while True:
        status = server.status()
        counts = status["trajectories"]
        if counts["buffered"] < batch and counts["trained"] + counts["buffered"] == counts["accepted"]:
            return status  # type: ignore[no-any-return]
        assert time.monotonic() < deadline, f"learner still busy after {limit}s: {counts}"
        time.sleep(0.3)


def test_one_of_two_servers_killed_and_resumed_loses_nothing_and_the_other_keeps_training(tmp_path):
    solo = tmp_path / "solo"
    solo.mkdir()
    (solo / "agent.py").write_text(SOLO)
    common = ["--batch-groups", "2", "--group-size", "8", "--max-staleness", "8", "--entropy-coef", "0.001"]
    a = ServerProcess([*common, "--state-dir", str(tmp_path / "a")], tmp_path / "a.log")
    b_port = free_port()
    b_args = [*common, "--checkpoint-every", "3", "--state-dir", str(tmp_path / "b")]
    b = ServerProcess(b_args, tmp_path / "b.log", port=b_port)
    exe = str(Path(sys.executable).parent / "agentjet-client")
    common_run = ["--group-size", "8", "--concurrency", "16", "--seed", "0"]
    team = [exe, "run", "--code-dir", str(ROOT / "examples" / "planner_executor"), "--server", a.url]
    runs = {
        "team": [*team, "--server", f"executor={b.url}", "--episodes", "192", *common_run],
        "on-a": [exe, "run", "--code-dir", str(solo), "--server", a.url, "--episodes", "640", *common_run],
        "on-b": [exe, "run", "--code-dir", str(solo), "--server", b.url, "--episodes", "192", *common_run],
    }
    env = {**os.environ, "AGENTJET_DIGITS": "3,8"}
    clients = {
        name: subprocess.Popen(
            [*command, "--spool-dir", str(tmp_path / f"spool-{name}")],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for name, command in runs.items()
    }
    started = time.monotonic()
    try:
        deadline = time.monotonic() + 300
        while b.status()["learner"]["step"] < 4:  # past its first checkpoint (step 3)
            assert all(c.poll() is None for c in clients.values()), "a client finished before the kill"
            assert time.monotonic() < deadline, b.status()
            time.sleep(0.1)
        print(f"B at step 4 after {time.monotonic() - started:.0f}s")
        before_t, before_n = time.monotonic(), accepted(a)
        time.sleep(3.0)
        rate_before = (accepted(a) - before_n) / (time.monotonic() - before_t)
        assert clients["on-a"].poll() is None, "run on-a finished before the kill"
        b.kill()
        down_t, down_n = time.monotonic(), accepted(a)
        checkpoint = latest_checkpoint(tmp_path / "b")
        time.sleep(5.0)  # the outage: B's clients see refused connections meanwhile
        b = ServerProcess([*b_args, "--resume"], tmp_path / "b.log", port=b_port)
        up_t, up_n = time.monotonic(), accepted(a)
        rate_during = (up_n - down_n) / (up_t - down_t)
        outs = {name: client.communicate(timeout=900)[0] for name, client in clients.items()}
        for name, client in clients.items():
            assert client.returncode == 0, f"{name}: {outs[name][-3000:]}"
        print(f"clients done after {time.monotonic() - started:.0f}s")
        final = {"a": settled(a), "b": settled(b)}
    finally:
        for client in clients.values():
            reap(client)
        a.stop()
        b.stop()
    feeds = {"a": ["team", "on-a"], "b": ["team", "on-b"]}
    servers = {"a": a, "b": b}
    lines = []
    for name, runs_of in feeds.items():
        stats = [spool_stats(tmp_path / f"spool-{run}" / spool_key(servers[name].url)) for run in runs_of]
        produced = sum(s.spooled for s in stats)
        answered = sum(s.spooled - s.depth for s in stats)
        log = TrajectoryLog(tmp_path / name / "log")
        logged = Counter(trajectory_id for _, trajectory_id in log.answers())
        log.close()
        repeated = [i for i, n in logged.items() if n > 1]
        lost = produced - len(logged)
        counts = final[name]["trajectories"]
        stale = counts["rejected_by_reason"].get("stale", 0)
        lines.append(
            f"server {name}: produced {produced}, answered {answered} (duplicate {sum(s.duplicate for s in stats)}, "
            f"stale {stale}), logged {len(logged)}, lost {lost}; accepted {counts['accepted']}, "
            f"trained {counts['trained']}, policy v{final[name]['policy_version']}"
        )
        assert answered == produced and lost == 0 and not repeated, lines[-1]
        assert counts["unsigned_turns"] == 0 and "not_sampled" not in counts["rejected_by_reason"], counts
    print(
        "\n".join(lines) + f"\nB killed at its checkpoint step {checkpoint['step']}, down {up_t - down_t:.1f}s; "
        f"A accepted {rate_before:.1f} episodes/s before, {rate_during:.1f} during the outage"
    )
    assert up_n - down_n >= 16, "server A took nothing while B was down"
