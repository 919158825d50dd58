"""Disk faults on a real server process: a full disk mid-append, and a state dir that turns read-only.

What must hold in both: every trajectory the server answered ``accepted`` (or ``duplicate``) is in
its log exactly once and is trained exactly once; every one answered 503 is accepted when it is
sent again; no answer is a 500; the server recovers without a restart where the disk recovers.
"""

from __future__ import annotations

import os
import resource
import sys
import time
from collections import Counter
from pathlib import Path

import httpx2
import pytest

from agentjet_client.protocol import Trajectory, Turn
from agentjet_server.ingest.wal import Accepted, TrajectoryLog, read_records
from tests.conftest import ServerProcess, free_port

pytestmark = pytest.mark.e2e
SERVER = str(Path(sys.executable).parent / "agentjet-server")
# runs the server (same pid) under a file-size limit: what a full disk does to a write, it stops part-way.
# Its output goes through a pipe to a forked copier, so the limit does not cut the server's own log short.
WITH_FILE_LIMIT = """
import os, resource, sys
r, w = os.pipe()
if os.fork() == 0:
    os.close(w)
    while chunk := os.read(r, 65536):
        os.write(1, chunk)
    os._exit(0)
os.close(r)
os.dup2(w, 1)
os.dup2(w, 2)
os.close(w)
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), resource.RLIM_INFINITY))
os.execv(sys.argv[2], sys.argv[2:])
"""


def server_args(model_dir: Path, state: Path, checkpoint_every: int) -> list[str]:
    """A step per pair of trajectories; staleness never in the way (the pushes are all version 0)."""
    args = ["--model", str(model_dir), "--state-dir", str(state), "--batch-groups", "1", "--group-size", "2"]
    return [*args, "--checkpoint-every", str(checkpoint_every), "--max-staleness", "1000"]


def trajectories(count: int, prefix: str) -> list[Trajectory]:
    """Pairs of one task (a GRPO group of 2) with rewards 0 and 1, so each pair is a real step."""
    out = []
    for i in range(count):
        turn = Turn(
            policy_version=0,
            prompt_token_ids=[1, 2, 3, 4 + i % 7],
            completion_token_ids=[5 + i % 11, 6],
            completion_logprobs=[-1.5, -0.5],
            finish_reason="stop",
        )
        out.append(Trajectory(id=f"{prefix}{i}", task_id=f"{prefix}task{i // 2}", turns=[turn], reward=float(i % 2)))
    return out


def push(url: str, trajectory: Trajectory) -> tuple[int, str]:
    """``(200, status[: reason])`` or ``(503, message)``; a 429 (nothing acknowledged) is sent again."""
    body = {"trajectories": [trajectory.model_dump(mode="json")]}
    r = httpx2.post(url + "/v1/trajectories", json=body, timeout=30)
    while r.status_code == 429:  # the buffer is full until the learner takes a batch: push again, as clients do
        time.sleep(0.2)
        r = httpx2.post(url + "/v1/trajectories", json=body, timeout=30)
    assert r.status_code in (200, 503), r.text  # never a 500
    if r.status_code == 503:
        return 503, r.json()["error"]["message"]
    result = r.json()["results"][0]
    return 200, result["status"] + (f": {result['reason']}" if result["reason"] else "")


def wait_until(server: ServerProcess, done: object, what: str, limit: float = 120) -> dict:  # type: ignore[type-arg]
    deadline = time.monotonic() + limit
    while True:
        status = server.status()
        if done(status):  # type: ignore[operator]
            return status
        assert time.monotonic() < deadline, f"{what}: {status}"
        time.sleep(0.1)


def check_sequence_numbers(state: Path) -> None:
    """The log's records not yet compacted (readable while the server runs) use each lsn once."""
    lsns = [r.lsn for r in read_records(state / "log") if isinstance(r, Accepted)]
    assert len(set(lsns)) == len(lsns), "a log sequence number was used twice"


def logged_ids(state: Path) -> Counter[str]:
    """How often each accepted id is in the log, compacted segments included (server stopped)."""
    log = TrajectoryLog(state / "log")
    try:
        return Counter(i for kind, i in log.answers() if kind == "a")
    finally:
        log.close()


def test_a_full_disk_mid_append_then_a_restart_loses_and_repeats_nothing(model_dir, tmp_path):
    state, log = tmp_path / "state", tmp_path / "server.log"
    args = server_args(model_dir, state, checkpoint_every=0)
    port = free_port()
    batch = trajectories(30, "d")
    one_record = len(batch[0].model_dump_json()) + 40
    # about a third of the pushes fit; one is cut off part-way; the rest find the disk full
    launcher = [sys.executable, "-c", WITH_FILE_LIMIT, str(one_record * 10 + one_record // 2), SERVER]
    server = ServerProcess(args, log, launcher=launcher, port=port)
    answers: dict[str, tuple[int, str]] = {}
    try:
        for trajectory in batch[:20]:
            answers[trajectory.id] = push(server.url, trajectory)
        # space is freed while the server runs: what a failed write left behind must not be published now
        resource.prlimit(server.proc.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        for trajectory in batch[20:]:
            answers[trajectory.id] = push(server.url, trajectory)
        check_sequence_numbers(state)
    finally:
        server.kill()  # a restart before the client retries
    refused = [i for i, (code, _) in answers.items() if code == 503]
    acknowledged = [i for i, (code, answer) in answers.items() if code == 200 and answer == "accepted"]
    assert 5 <= len(acknowledged) - 10 <= 15 and len(refused) == len(batch) - len(acknowledged), answers
    assert all(i in acknowledged for i in answers if int(i[1:]) >= 20)  # the freed disk takes writes again
    assert "File too large" in answers[refused[0]][1] and "retry" in answers[refused[0]][1]

    server = ServerProcess([*args, "--resume"], log, port=port)
    try:
        again = {t.id: push(server.url, t)[1].split(":")[0] for t in batch}
        assert {i for i, a in again.items() if a == "accepted"} == set(refused)  # every 503 accepted now
        assert {i for i, a in again.items() if a == "duplicate"} == set(acknowledged)
        final = wait_until(
            server,
            lambda s: s["trajectories"]["trained"] == len(batch) and s["trajectories"]["buffered"] == 0,
            "the learner did not train every trajectory",
        )
        check_sequence_numbers(state)  # before the shutdown checkpoint compacts the log to ids
    finally:
        server.stop()
    ids = logged_ids(state)
    counts = final["trajectories"]
    print(
        f"full disk: {len(acknowledged)} accepted, {len(refused)} answered 503 then accepted after the restart; "
        f"log holds {len(ids)} ids, each {set(ids.values())} time(s); trained {counts['trained']}"
    )
    assert set(ids) == {t.id for t in batch} and set(ids.values()) == {1}
    assert counts["accepted"] == len(batch) and counts["trained"] == len(batch)


def _set_writable(state: Path, writable: bool) -> None:
    for path in [state, *(p for p in state.rglob("*") if p.is_dir())]:
        os.chmod(path, 0o700 if writable else 0o500)


def test_a_read_only_state_dir_refuses_then_recovers_without_a_restart(model_dir, tmp_path):
    state, log = tmp_path / "state", tmp_path / "server.log"
    args = server_args(model_dir, state, checkpoint_every=1)
    port = free_port()
    # root ignores file modes: run the server without the capabilities that let it
    launcher = (
        [SERVER] if os.geteuid() != 0 else ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", SERVER]
    )
    server = ServerProcess(args, log, launcher=launcher, port=port)
    batch = trajectories(24, "r")
    answers: dict[str, tuple[int, str]] = {}
    try:
        for trajectory in batch[:4]:
            answers[trajectory.id] = push(server.url, trajectory)
        wait_until(server, lambda s: s["learner"]["last_checkpoint_step"] == 2, "no checkpoint before the fault")
        _set_writable(state, False)
        try:
            for trajectory in batch[4:12]:
                answers[trajectory.id] = push(server.url, trajectory)
            broken = wait_until(
                server,
                lambda s: "checkpoint failed" in (s["learner"]["last_error"] or ""),
                "a checkpoint into a read-only state dir did not fail visibly",
            )
            assert "Permission denied" in broken["learner"]["last_error"]
            assert broken["learner"]["last_checkpoint_step"] == 2
        finally:
            _set_writable(state, True)
        for trajectory in batch[12:]:
            answers[trajectory.id] = push(server.url, trajectory)
        for trajectory_id, (code, _) in list(answers.items()):
            if code == 503:  # what the client's spool does: send it again
                answers[trajectory_id] = push(server.url, next(t for t in batch if t.id == trajectory_id))
        recovered = wait_until(
            server,
            lambda s: s["learner"]["last_checkpoint_step"] == s["learner"]["step"] and not s["learner"]["last_error"],
            "no checkpoint after the state dir became writable again",
        )
        assert recovered["learner"]["step"] > 2
    finally:
        server.kill()
    assert all(a == (200, "accepted") for a in answers.values()), answers
    server = ServerProcess([*args, "--resume"], log, port=port)
    try:
        final = wait_until(
            server,
            lambda s: s["trajectories"]["trained"] == len(batch) and s["trajectories"]["buffered"] == 0,
            "the resumed server did not train every trajectory",
        )
        check_sequence_numbers(state)
    finally:
        server.stop()
    ids = logged_ids(state)
    refused = sum(1 for line in log.read_text().splitlines() if "state error on /v1/trajectories" in line)
    print(
        f"read-only state dir: {len(batch)} pushed, {refused} answered 503 on the way, checkpoint failed while "
        f"read-only and succeeded at step {recovered['learner']['step']} without a restart; after SIGKILL + resume "
        f"trained {final['trajectories']['trained']}, log holds each id {set(ids.values())} time(s)"
    )
    assert set(ids) == {t.id for t in batch} and set(ids.values()) == {1}
    assert final["trajectories"]["accepted"] == len(batch)
