"""The runner against a real server: groups, failures isolated to their episode, timeouts, reports."""

import asyncio

import pytest

from agentjet_client import RunConfig, Runner, SwarmClient, swarm_agent
from agentjet_client.tasks.agent import SwarmAgent

ASK = [{"role": "user", "content": "Write four as a digit."}]


def make_agent() -> SwarmAgent:
    @swarm_agent(tasks=[{"id": "ok"}, {"id": "boom"}, {"id": "hang"}, {"id": "bad-reward"}])
    async def agent(task, episode):
        reply = await episode.async_openai().chat.completions.create(model="agentjet-tiny", messages=ASK, max_tokens=3)
        if task["id"] == "boom":
            raise ValueError("agent bug")
        if task["id"] == "hang":
            await asyncio.sleep(3600)
        if task["id"] == "bad-reward":
            return "yes"
        return float(reply.choices[0].message.content.strip() == "4")

    return agent


def test_runner_isolates_failures_and_times_out(live_server):
    with SwarmClient(live_server.url) as client:
        before = client.status().trajectories
        runner = Runner(client, make_agent(), RunConfig(episodes=8, group_size=2, concurrency=8, timeout=5.0, seed=0))
        report = asyncio.run(runner.run())
        after = client.status().trajectories
    assert report.finished == report.started == 8
    assert report.failed == 6 and len(report.rewards) == 2  # boom, hang, bad-reward fail; ok succeeds
    assert report.accepted == 8 and report.rejected == 0
    assert after.accepted - before.accepted == 8
    reasons = report.failure_reasons
    # the hung episodes were abandoned, not awaited (5 s: an answered call never takes that long, even when
    # a loaded machine makes it take more than 1 s, which timed the other episodes out too)
    assert reasons["episode timed out after 5s (--timeout)"] == 2
    assert reasons["ValueError: agent bug (test_runner.py:18 in agent)"] == 2  # where in the agent
    assert sum(n for r, n in reasons.items() if "agent returned 'yes'" in r) == 2


def test_sync_agents_run_in_threads(live_server):
    @swarm_agent(tasks=[{"id": "s"}])
    def sync_agent(task, episode):
        reply = episode.openai().chat.completions.create(model="agentjet-tiny", messages=ASK, max_tokens=3)
        return reply.choices[0].message.content.strip() == "4"

    with SwarmClient(live_server.url) as client:
        report = asyncio.run(Runner(client, sync_agent, RunConfig(episodes=4, group_size=2, concurrency=4)).run())
    assert report.finished == 4 and report.failed == 0 and report.accepted == 4
    assert all(r in (0.0, 1.0) for r in report.rewards)


def test_spool_keeps_trajectories_while_the_server_is_down_and_a_new_run_delivers_them(live_server, tmp_path):
    """Nothing finished is lost: with no server, episodes wait in the spool; the next run sends them first."""
    import socket
    import threading

    from agentjet_client import Spool

    @swarm_agent(tasks=[{"id": "offline"}])
    def no_llm(task, episode):  # makes no LLM call: a failed (untrainable) but real trajectory
        return 0.0

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    spool = Spool(tmp_path / "spool")
    config = RunConfig(episodes=6, group_size=2, concurrency=4, admission=False, backoff_max=0.2)
    with SwarmClient(dead, attempts=1) as client:
        runner = Runner(client, no_llm, config, spool=spool)
        threading.Timer(2.0, runner.stop).start()
        report = asyncio.run(runner.run())
    assert report.finished == 6 and report.accepted == 0
    stats = spool.stats()
    assert stats.depth == 6 and stats.spooled == 6 and stats.sent >= 6
    assert "cannot reach" in stats.last_error

    with SwarmClient(live_server.url) as client:
        before = client.status().trajectories.accepted
        runner = Runner(client, make_agent(), RunConfig(episodes=2, group_size=2, seed=0, timeout=1.0), spool=spool)
        report = asyncio.run(runner.run())
        after = client.status().trajectories.accepted
    assert report.resent_leftovers == 6 and report.accepted == 8
    assert after - before == 8 and spool.depth == 0


def test_a_read_only_spool_never_reaches_the_agent_and_loses_nothing(live_server, tmp_path):
    """The spool's database turns read-only (SQLite ``query_only``) mid-run: finished trajectories
    wait in memory and are retried, new episodes wait, and once it is writable again every episode
    is delivered. The agents never see an error."""
    import threading

    from agentjet_client import Spool

    spool = Spool(tmp_path / "spool")
    spool._db.execute("PRAGMA query_only = 1")  # what a read-only or full disk looks like to SQLite

    def heal() -> None:
        with spool._lock:
            spool._db.execute("PRAGMA query_only = 0")

    timer = threading.Timer(1.5, heal)
    timer.start()
    try:
        with SwarmClient(live_server.url) as client:
            before = client.status().trajectories.accepted
            config = RunConfig(episodes=6, group_size=2, concurrency=4, seed=0)
            report = asyncio.run(Runner(client, make_agent_ok(), config, spool=spool).run())
            after = client.status().trajectories.accepted
    finally:
        timer.cancel()
        spool.close()
    assert report.spool_errors >= 1 and report.failed == 0  # the agents never saw it
    assert report.finished == 6 and report.accepted == 6 and after - before == 6


def make_agent_ok() -> SwarmAgent:
    @swarm_agent(tasks=[{"id": "ok"}])
    async def agent(task, episode):
        reply = await episode.async_openai().chat.completions.create(model="agentjet-tiny", messages=ASK, max_tokens=3)
        return float(reply.choices[0].message.content.strip() == "4")

    return agent


def test_sync_mode_trains_every_batch_before_the_next_one_starts(model_dir):
    """``--sync``: rounds of the server's batch_groups x group_size episodes, each trained (and its
    weights live) before the next starts, so every trained token was sampled by the weights it updated."""
    import random

    from tests.conftest import LiveServer

    @swarm_agent(tasks=[{"id": "a"}, {"id": "b"}, {"id": "c"}])
    async def agent(task, episode):
        await episode.async_openai().chat.completions.create(model="agentjet-tiny", messages=ASK, max_tokens=3)
        await asyncio.sleep(random.uniform(0, 0.2))  # a slow, uneven environment
        return random.random()  # every group has a reward signal: every round is a step

    server = LiveServer(model_dir, batch_groups=2, group_size=3, max_staleness=4)
    try:
        with SwarmClient(server.url) as client:
            config = RunConfig(episodes=18, group_size=5, concurrency=16, seed=0, sync=True)
            report = asyncio.run(Runner(client, agent, config).run())
            status = client.status()
    finally:
        server.stop()
    assert report.rounds == 3 and report.finished == report.accepted == 18  # the server's 2 x 3, not --group-size 5
    assert status.learner.step == 3 and status.policy_version == 3 and status.trajectories.trained == 18
    lag = status.learner.trained_token_lag
    assert set(lag) == {"0"} and lag["0"] > 0, lag  # staleness 0: synchronous
    assert report.waiting_for_learner_s > 0


def test_an_unreadable_spooled_item_is_rejected_not_resent_forever(live_server, tmp_path):
    """A spooled item no server could take (here: a complete episode without turns, written as-is)
    is settled as rejected and the run goes on instead of its sender stopping at it."""
    from agentjet_client import Spool
    from agentjet_client.protocol import Trajectory

    spool = Spool(tmp_path / "spool")
    with SwarmClient(live_server.url) as client:
        good = make_agent()
        bad = Trajectory(id="bad-1", task_id="t", turns=[_a_turn(client)], reward=0.0).model_copy(update={"turns": []})
        spool.put(bad)
        runner = Runner(
            client, good, RunConfig(episodes=2, group_size=2, concurrency=2, timeout=5.0, seed=0), spool=spool
        )
        report = asyncio.run(runner.run())
    assert report.finished == 2 and spool.depth == 0
    assert report.reject_reasons["not a valid trajectory (in the spool)"] == 1
    assert report.resent_leftovers == 1
    spool.close()


def _a_turn(client):
    with client.episode("one-turn") as episode:
        episode.openai().chat.completions.create(model="agentjet-tiny", messages=ASK, max_tokens=2)
        return episode.recorder.turns[0]


def inject_fault(monkeypatch: pytest.MonkeyPatch, where: str, after: int) -> None:
    """Fault injection into our own code around an episode: from the ``after``-th call on, recording
    the finished episode in the report, or writing the spool, raises ``RuntimeError("bookkeeping bug")``."""
    from agentjet_client.delivery.spool import Spool
    from agentjet_client.run.report import RunReport

    owner, name = {"report": (RunReport, "record_episode"), "spool": (Spool, "put_many")}[where]
    original, calls = getattr(owner, name), []

    def faulty(self, *args, **kwargs):
        calls.append(1)
        if len(calls) > after:  # a bug that every later episode meets
            raise RuntimeError("bookkeeping bug")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(owner, name, faulty)


@pytest.mark.parametrize("where", ["report", "spool"])
def test_an_error_of_our_own_around_an_episode_ends_the_run_at_once_and_loses_nothing_spooled(
    live_server, tmp_path, monkeypatch, where
):
    """Our code around an episode raising (not the agent's code) ends the run with that error, instead
    of the run waiting for admission room that the lost episodes never free. What was spooled stays
    spooled or reached the server; the next run delivers the rest, and nothing twice."""
    from agentjet_client import Spool

    spool = Spool(tmp_path / "spool")
    with SwarmClient(live_server.url) as client:
        before = client.status().trajectories.accepted
        with monkeypatch.context() as patch:
            inject_fault(patch, where, after=2)
            runner = Runner(client, make_agent_ok(), RunConfig(episodes=400, group_size=2, concurrency=4), spool=spool)
            with pytest.raises(RuntimeError, match="bookkeeping bug"):
                asyncio.run(asyncio.wait_for(runner.run(), 120))  # a hang fails this test, not the suite
        assert runner.report.started < 400  # it ended at the error, not after the run's episodes
        spooled, left = spool.stats().spooled, spool.depth
        assert client.status().trajectories.accepted - before + left >= spooled  # each delivered, or still spooled

        config = RunConfig(episodes=2, group_size=2, concurrency=2, seed=0)
        report = asyncio.run(Runner(client, make_agent_ok(), config, spool=spool).run())
        after = client.status().trajectories.accepted
    assert report.resent_leftovers == left and spool.depth == 0
    assert after - before == spooled + 2  # everything spooled reached the server once
    spool.close()


def test_the_command_line_fails_with_the_traceback_of_an_error_of_our_own(live_server, tmp_path):
    """``agentjet-client run`` whose runner meets a bug of ours exits 1 with the error's traceback
    (the fault injected as above, in the command's own process)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = (
        "import sys, pytest\n"
        "from tests.client.run.test_runner import inject_fault\n"
        "with pytest.MonkeyPatch.context() as patch:\n"
        "    inject_fault(patch, 'report', after=2)\n"
        "    from agentjet_client.cli import main\n"
        "    sys.argv[0] = 'agentjet-client'\n"
        "    main()\n"
    )
    root = Path(__file__).resolve().parents[3]
    command = [sys.executable, "-c", script, "run", "--code-dir", str(root / "examples" / "digits")]
    command += ["--server", live_server.url, "--episodes", "400", "--group-size", "2", "--concurrency", "4"]
    command += ["--spool-dir", str(tmp_path / "spool"), "--no-watch"]
    env = {**os.environ, "AGENTJET_DIGITS": "3,8", "COLUMNS": "200"}
    proc = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "the run stopped on an unexpected error" in proc.stderr
    assert "RuntimeError: bookkeeping bug" in proc.stderr and "record_episode" in proc.stderr, proc.stderr[-3000:]


def test_new_groups_take_the_servers_group_size_when_an_admin_changes_it(model_dir, caplog):
    import httpx2

    from tests.conftest import LiveServer

    server = LiveServer(model_dir, batch_groups=1, group_size=2)

    @swarm_agent(tasks=[{"id": "a"}, {"id": "b"}])
    async def agent(task, episode):
        await episode.async_openai().chat.completions.create(model="agentjet-tiny", messages=ASK, max_tokens=2)
        return 1.0

    try:
        config = RunConfig(episodes=10, group_size=2, concurrency=1, follow_group_size=True, poll_interval=0.05)
        with SwarmClient(server.url) as client:
            runner = Runner(client, agent, config)

            def switch(report) -> None:  # after the first group: an admin changes the group size
                if report.finished == 2:
                    httpx2.patch(server.url + "/v1/admin/config", json={"group_size": 4}).raise_for_status()

            runner.rollouts._on_progress = switch
            with caplog.at_level("WARNING", logger="agentjet_client.delivery.admission"):
                report = asyncio.run(runner.run())
        groups = [t["task_id"] for t in server.runtime.recent.newest(100) if t["purpose"] == "train"]
    finally:
        server.stop()
    assert "the server's group size changed from 2 to 4" in caplog.text
    assert report.started == 10 and report.accepted == 10
    sizes = sorted(groups.count(g) for g in set(groups))  # groups started before the change keep their 2
    assert set(sizes) == {2, 4} and sum(sizes) == 10, sizes


def test_the_summary_takes_the_version_the_server_trained_to_after_the_last_push(live_server):
    """A short run pushes everything before the learner's first step: the summary's version is the
    server's as the run ends, not the last push's answer (it said ``v0 -> v0`` after training to v3)."""
    import time

    from agentjet_client.run.session import version_now

    seen: dict[str, int] = {}

    @swarm_agent(tasks=[{"id": "a"}, {"id": "b"}])
    async def alternating(task, episode):  # the two episodes of a group get 0 and 1: every group trains
        await episode.async_openai().chat.completions.create(model="agentjet-tiny", messages=ASK, max_tokens=2)
        seen[task["id"]] = seen.get(task["id"], 0) + 1
        return float(seen[task["id"]] % 2)

    with SwarmClient(live_server.url) as client:
        report = asyncio.run(Runner(client, alternating, RunConfig(episodes=8, group_size=2, concurrency=2)).run())
        pushed = report.last_version
        assert pushed is not None
        deadline = time.monotonic() + 60
        while (now := client.status().policy_version) <= pushed:  # the learner's steps after the last push
            assert time.monotonic() < deadline, "the server did not train on the run's groups"
            time.sleep(0.1)
        report.final_version = version_now(client)
        assert report.last_version is not None and report.last_version >= now > pushed
    with SwarmClient("http://127.0.0.1:9", attempts=1) as gone:
        report.final_version = version_now(gone)
        assert report.final_version is None and report.last_version == pushed  # no server to ask: the last answer's
