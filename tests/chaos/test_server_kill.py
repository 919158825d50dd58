"""Fault injection: the server is killed with SIGKILL twice during a client run and restarted with
``--resume`` on the same state dir and port.

Counts, at the end: produced (trajectories the client committed to its spool), answered (removed
from the spool because the server answered), duplicate answers (resends of trajectories the server
had logged before dying), the ids in the server's trajectory log (each must be there exactly once),
and lost = produced - ids in the log. Lost must be 0; the server must resume at the version of its
last checkpoint and, by the end, have trained every trajectory it accepted exactly once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx2
import pytest

from agentjet_client.delivery.spool import spool_key
from agentjet_server.ingest.wal import Accepted, TrajectoryLog, read_records
from tests.chaos.test_client_kill import spool_stats
from tests.conftest import ServerProcess, free_port, reap

pytestmark = pytest.mark.e2e
EPISODES = 480
AGENT = """
import asyncio

from agentjet_client import swarm_agent

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


@swarm_agent(tasks=[{"id": f"digit-{d}", "word": WORDS[d], "answer": str(d)} for d in (3, 8)])
async def slow_digit(task, episode):
    await asyncio.sleep(0.3)  # an environment that takes a while: keeps the run going across the kills
    reply = await episode.async_openai().chat.completions.create(
        model="agentjet-tiny",
        messages=[{"role": "user", "content": f"Write {task['word']} as a digit."}],
        max_tokens=4,
    )
    return 1.0 if (reply.choices[0].message.content or "").strip() == task["answer"] else 0.0
"""


def latest_checkpoint(state: Path) -> dict:  # type: ignore[type-arg]
    done = sorted(p for p in (state / "checkpoints").glob("step-*") if not p.name.endswith(".tmp"))
    assert done, "no checkpoint was written before the kill"
    return json.loads((done[-1] / "state.json").read_text())  # type: ignore[no-any-return]


def wait_for_step(server: ServerProcess, client: subprocess.Popen[str], step: int) -> dict:  # type: ignore[type-arg]
    deadline = time.monotonic() + 180
    while True:
        assert client.poll() is None, "the client finished before the kill; it should still be running"
        status = server.status()
        if status["learner"]["step"] >= step:
            return status  # type: ignore[no-any-return]
        assert time.monotonic() < deadline, f"the server did not reach step {step}: {status}"
        time.sleep(0.05)


def test_server_killed_twice_and_resumed_loses_nothing(tmp_path):
    code = tmp_path / "agent"
    code.mkdir()
    (code / "agent.py").write_text(AGENT)
    state, spool_dir = tmp_path / "state", tmp_path / "spool"
    port = free_port()
    args = ["--batch-groups", "2", "--group-size", "8", "--checkpoint-every", "3", "--state-dir", str(state)]
    args += ["--max-staleness", "8", "--entropy-coef", "0.001"]  # a batch whose groups all tie steps too
    log = tmp_path / "server.log"
    server = ServerProcess(args, log, port=port)
    exe = str(Path(sys.executable).parent / "agentjet-client")
    command = [exe, "run", "--code-dir", str(code), "--server", server.url, "--episodes", str(EPISODES)]
    command += ["--group-size", "8", "--concurrency", "16", "--spool-dir", str(spool_dir)]
    client = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    resumed_at = []
    try:
        for kill in range(2):
            at_kill = wait_for_step(server, client, (resumed_at[-1]["step"] if resumed_at else 0) + 5)
            server.kill()
            if kill == 1:  # some trajectories this server had acknowledged, to resend after the restart
                logged_before = [r.trajectory for r in read_records(state / "log") if isinstance(r, Accepted)][-5:]
            checkpoint = latest_checkpoint(state)
            print(
                f"kill {kill + 1}: server at step {at_kill['learner']['step']} (v{at_kill['policy_version']}), "
                f"last checkpoint step {checkpoint['step']} (v{checkpoint['version']})"
            )
            time.sleep(1.0)  # the client notices: pushes and status polls fail meanwhile
            server = ServerProcess([*args, "--resume"], log, port=port)
            resumed_at.append(checkpoint)
            assert f"(step {checkpoint['step']}, policy v{checkpoint['version']})" in log.read_text()
            status = server.status()
            # training continues from the checkpointed version (replayed batches may already have moved it on)
            assert status["policy_version"] >= checkpoint["version"]
            assert status["policy_version"] - checkpoint["version"] == status["learner"]["step"] - checkpoint["step"]
        # the seen ids survived the SIGKILL: a resend is a duplicate, not a second training
        resent = httpx2.post(server.url + "/v1/trajectories", json={"trajectories": logged_before}).json()
        assert [r["status"] for r in resent["results"]] == ["duplicate"] * 5
        out, _ = client.communicate(timeout=600)
        assert client.returncode == 0, out
        deadline = time.monotonic() + 60
        while server.status()["trajectories"]["buffered"] >= 16 and time.monotonic() < deadline:
            time.sleep(0.1)  # the last full batches get trained
        final = server.status()
    finally:
        reap(client)
        server.stop()
    stats = spool_stats(spool_dir / spool_key(server.url))
    trajectory_log = TrajectoryLog(state / "log")
    logged = Counter(trajectory_id for _, trajectory_id in trajectory_log.answers())
    trajectory_log.close()
    repeated = [i for i, n in logged.items() if n > 1]
    produced, answered = stats.spooled, stats.spooled - stats.depth
    lost = produced - len(logged)
    counts = final["trajectories"]
    print(
        f"server SIGKILL x2: produced {produced}, answered {answered} (accepted {stats.accepted}, "
        f"duplicate {stats.duplicate}, rejected {stats.rejected}), in the server log {len(logged)} "
        f"(repeated {len(repeated)}), lost {lost}; server: accepted {counts['accepted']}, "
        f"trained {counts['trained']}, buffered {counts['buffered']}, policy v{final['policy_version']}"
    )
    assert produced >= 300 and stats.depth == 0 and answered == produced
    assert lost == 0 and not repeated
    assert counts["accepted"] + counts["rejected"] == len(logged) and counts["duplicate"] >= 5
    # samples from before each restart still verify (the resumed run keeps its signing key)
    assert "not_sampled" not in counts["rejected_by_reason"] and counts["unsigned_turns"] == 0
    assert counts["verified_turns"] > 0
    assert counts["trained"] + counts["buffered"] == counts["accepted"]  # each accepted one trained once
    assert final["policy_version"] == final["learner"]["step"]  # one version per step, no gaps or repeats
    print("client:", out.strip().splitlines()[-2:])  # episodes in flight at a kill fail (their LLM call did)


def test_resume_on_another_port_refuses_a_live_state_dir(tmp_path):
    """A second server on the same state dir is refused while the first runs."""
    state = tmp_path / "state"
    server = ServerProcess(["--state-dir", str(state)], tmp_path / "first.log")
    try:
        env = {**os.environ}
        exe = str(Path(sys.executable).parent / "agentjet-server")
        second = subprocess.run(
            [exe, "up", "--port", str(free_port()), "--state-dir", str(state), "--resume"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode == 2
        assert f"is in use by agentjet-server pid {server.proc.pid}" in " ".join(second.stderr.split())
        assert httpx2.get(server.url + "/healthz").status_code == 200
    finally:
        server.stop()
