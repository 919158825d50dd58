"""The durable spool: committed before put returns, survives a killed process, bounded, clear errors."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from agentjet_client.delivery.spool import Spool, SpoolError
from agentjet_client.protocol import Trajectory, Turn


def trajectory(i: int) -> Trajectory:
    turn = Turn(
        policy_version=0,
        prompt_token_ids=[1, 2, 3],
        completion_token_ids=[4, 5],
        completion_logprobs=[-0.5, -0.1],
        finish_reason="stop",
    )
    return Trajectory(id=f"t{i}", task_id="task", turns=[turn], reward=float(i % 2))


def test_put_peek_settle_and_counters(tmp_path):
    spool = Spool(tmp_path)
    for i in range(5):
        assert spool.put(trajectory(i))
    assert not spool.put(trajectory(0))  # same id: kept once
    items = spool.peek(3)
    assert [i for i, _ in items] == ["t0", "t1", "t2"] and items[1][1] == trajectory(1)
    spool.mark_sent(["t0", "t1", "t2"])
    spool.settle({"t0": "accepted", "t1": "duplicate", "t2": "rejected"})
    stats = spool.stats()
    assert (stats.depth, stats.spooled, stats.sent, stats.accepted, stats.duplicate, stats.rejected) == (
        2,
        5,
        3,
        1,
        1,
        1,
    )
    spool.note_error("server unreachable")
    assert "last error: server unreachable" in spool.stats().summary()


def test_items_survive_reopening(tmp_path):
    spool = Spool(tmp_path)
    for i in range(3):
        spool.put(trajectory(i))
    spool.settle({"t0": "accepted"})
    spool.close()
    again = Spool(tmp_path)
    assert [i for i, _ in again.peek(10)] == ["t1", "t2"]
    assert again.stats().accepted == 1


def test_a_process_killed_right_after_put_loses_nothing(tmp_path):
    """``put`` returns only once the row is committed: SIGKILL straight after it keeps every item."""
    script = textwrap.dedent(
        f"""
        import os, signal, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_spool import trajectory
        from agentjet_client.delivery.spool import Spool
        spool = Spool(__import__("pathlib").Path({str(tmp_path)!r}))
        for i in range(200):
            spool.put(trajectory(i))
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -9, proc.stderr
    survivor = Spool(tmp_path)
    assert survivor.depth == 200
    assert len(survivor.peek(500)) == 200  # its owner is dead: the next spool adopts and sends them


def test_full_is_reported_not_dropped(tmp_path):
    spool = Spool(tmp_path, max_items=3)
    for i in range(4):  # an episode already running still lands
        assert spool.put(trajectory(i))
    assert spool.full and spool.depth == 4
    spool.settle({"t0": "accepted", "t1": "accepted"})
    assert not spool.full


def test_unwritable_directory_is_a_clear_error(tmp_path):
    if os.geteuid() == 0:
        target = "/proc/agentjet-spool"  # not creatable, even for root
    else:
        tmp_path.chmod(0o500)
        target = str(tmp_path / "spool")
    with pytest.raises(SpoolError, match="--spool-dir"):
        Spool(__import__("pathlib").Path(target))


def test_group_commit_puts_concurrent_trajectories_in_few_transactions(tmp_path):
    import asyncio

    from agentjet_client.delivery.spool import GroupCommit

    spool = Spool(tmp_path)
    group = GroupCommit(spool.put_many)

    async def finish_together() -> list[bool]:
        return await asyncio.gather(*(group.put(trajectory(i)) for i in range(64)), group.put(trajectory(0)))

    inserted = asyncio.run(finish_together())
    assert inserted == [True] * 64 + [False]  # the repeated id is reported, not stored twice
    assert spool.depth == 64 and spool.stats().spooled == 64
    assert 1 <= group.commits <= 3  # 65 puts, one transaction for everything that arrived together
    assert [t.id for _, t in spool.peek(3)] == ["t0", "t1", "t2"]  # in the order they finished
    spool.close()

    async def after_close() -> None:
        await asyncio.gather(group.put(trajectory(100)), group.put(trajectory(101)))

    with pytest.raises(SpoolError):  # every waiting episode sees the failure; nothing is claimed stored
        asyncio.run(after_close())


def test_opening_a_spool_while_another_process_creates_it_waits(tmp_path):
    """A reader (``agentjet-client status``, a test) opening the spool the moment a runner creates it waits, not fails.

    Switching a new database to WAL takes a lock SQLite's busy handler does not wait for; before the
    retry this failed about once in 40 races (on either side).
    """
    import time

    writer = textwrap.dedent(
        f"""
        import pathlib, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_spool import trajectory
        from agentjet_client.delivery.spool import Spool
        spool = Spool(pathlib.Path(sys.argv[1]))
        for i in range(100):
            spool.put(trajectory(i))
        """
    )
    for attempt in range(20):
        directory = tmp_path / str(attempt)
        proc = subprocess.Popen([sys.executable, "-c", writer, str(directory)], stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 30
        while not (directory / "spool.db").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.0005)
        for _ in range(10):
            Spool(directory).close()
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert Spool(directory).depth == 100


def test_leftovers_of_another_server_run_are_set_aside_not_sent(tmp_path):
    from agentjet_client.delivery.spool import SET_ASIDE, open_for_run

    spool, aside = open_for_run(tmp_path, "run-a")
    assert aside == 0 and spool.put_many([trajectory(i) for i in range(3)]) == [True] * 3
    spool.close()
    spool, aside = open_for_run(tmp_path, "run-a")  # the same server run: kept, to be sent
    assert aside == 0 and spool.depth == 3
    spool.close()
    spool, aside = open_for_run(tmp_path, "run-b")  # a new run of the server: set aside
    assert aside == 3 and spool.depth == 0 and spool.server_run == "run-b"
    spool.close()
    kept = Spool(tmp_path / SET_ASIDE / "run-a")
    assert kept.depth == 3 and [i for i, _ in kept.peek(5)] == ["t0", "t1", "t2"]  # nothing lost
    kept.close()


def test_the_command_line_sets_aside_what_another_server_run_left(live_server, tmp_path):
    import httpx2

    from agentjet_client.delivery.spool import open_for_run, spool_key

    spool_dir = tmp_path / "spool"
    spool, _ = open_for_run(spool_dir / spool_key(live_server.url), "an-earlier-run")
    spool.put_many([trajectory(i) for i in range(3)])
    spool.close()
    before = httpx2.get(live_server.url + "/v1/status").json()["trajectories"]
    code = os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples", "digits")
    command = [os.path.join(os.path.dirname(sys.executable), "agentjet-client"), "run", "--code-dir", code]
    command += ["--server", live_server.url, "--episodes", "4", "--spool-dir", str(spool_dir)]
    out = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "set aside 3 trajectories an earlier run left for another run of the server" in " ".join(out.stdout.split())
    after = httpx2.get(live_server.url + "/v1/status").json()["trajectories"]
    assert after["accepted"] - before["accepted"] == 4 and after["rejected"] == before["rejected"]


def test_spools_sharing_a_directory_send_only_their_own_and_adopt_what_a_closed_one_left(tmp_path, monkeypatch):
    """Two processes on one machine share the default spool directory: each sends only the items it put (so
    each hears its own answers), and items whose owner closed or died go to the next spool that looks."""
    import agentjet_client.delivery.spool as spool_module

    monkeypatch.setattr(spool_module, "ADOPT_EVERY_S", 0.0)
    first, second = Spool(tmp_path), Spool(tmp_path)
    first.put_many([trajectory(i) for i in range(3)])
    second.put_many([trajectory(i) for i in range(3, 5)])
    assert [i for i, _ in first.peek(10)] == ["t0", "t1", "t2"]
    assert [i for i, _ in second.peek(10)] == ["t3", "t4"]
    first.settle({"t0": "accepted"})
    first.close()
    assert [i for i, _ in second.peek(10)] == ["t1", "t2", "t3", "t4"]
    assert Spool(tmp_path).peek(10) == []  # all taken by the open one


def test_two_runs_on_one_machine_sharing_the_spool_directory_both_finish_without_resending(live_server, tmp_path):
    """Two ``agentjet-client run`` at once with one spool directory (as two runs with the default one): before
    spools had owners, each sent the other's trajectories and settled them, and both waited forever for the
    answers to their own."""
    import httpx2

    before = httpx2.get(live_server.url + "/v1/status").json()["trajectories"]
    code = os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples", "digits")
    command = [os.path.join(os.path.dirname(sys.executable), "agentjet-client"), "run", "--code-dir", code]
    command += ["--server", live_server.url, "--episodes", "48", "--spool-dir", str(tmp_path / "spool")]
    runs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outputs = [run.communicate(timeout=180)[0] for run in runs]
    assert [run.returncode for run in runs] == [0, 0], outputs
    after = httpx2.get(live_server.url + "/v1/status").json()["trajectories"]
    assert after["accepted"] - before["accepted"] == 96
    assert after["duplicate"] == before["duplicate"] and after["rejected"] == before["rejected"]
