"""End to end: ``agentjet-client research run`` as a real process, driving real ``agentjet-server up``
and ``agentjet-client run`` processes per trial on loopback, with the faults a study that runs for
days meets: a trial's server SIGKILLed mid-run, a collapsing trial, the runner itself SIGKILLed and
started again, and Ctrl-C.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import CACHE

ROOT = Path(__file__).resolve().parents[2]
CLIENT = [sys.executable, "-m", "agentjet_client"]

pytestmark = pytest.mark.e2e


def study_file(tmp_path: Path, space: str, trial: str = "episodes = 1400", extra: str = "") -> Path:
    path = tmp_path / "study.toml"
    path.write_text(
        f"""
[study]
name = "test study"
poll_seconds = 0.5
{extra}

[trial]
{trial}
eval_episodes = 32

[server]
batch_groups = 4
checkpoint_every = 5

[client]
code_dir = "{ROOT / "examples" / "digits"}"
concurrency = 16
env = {{ AGENTJET_DIGITS = "3,8" }}

[space]
{space}

[stop]
window = 160
"""
    )
    return path


def start_runner(study: Path, out: Path, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "AGENTJET_CACHE_DIR": str(CACHE)}
    with log.open("ab") as f:
        return subprocess.Popen(
            [*CLIENT, "research", "run", str(study), "--out", str(out)], stdout=f, stderr=f, env=env
        )


def record(out: Path, trial_id: str) -> dict[str, Any]:
    for _ in range(600):  # written atomically; read again if a test catches the rename or the runner is starting
        try:
            return json.loads((out / "trials" / trial_id / "trial.json").read_text())  # type: ignore[no-any-return]
        except (FileNotFoundError, json.JSONDecodeError):
            time.sleep(0.05)
    raise AssertionError(f"no trial.json for {trial_id}")


def wait_for(what: str, check: Any, runner: subprocess.Popen[bytes], log: Path, limit: float = 300) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if check():
            return
        if runner.poll() is not None:
            raise AssertionError(f"the runner exited ({runner.returncode}) before {what}:\n{log.read_text()[-4000:]}")
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}:\n{log.read_text()[-4000:]}")


def snapshot(out: Path, trial_id: str) -> dict[str, Any]:
    """What a finished trial is on disk: its record, its server's state files and their times."""
    state = out / "trials" / trial_id / "state"
    files = {
        str(p.relative_to(state)): (p.stat().st_size, p.stat().st_mtime_ns) for p in state.rglob("*") if p.is_file()
    }
    return {
        "record": record(out, trial_id),
        "files": files,
        "log": (out / "trials" / trial_id / "server.log").read_text(),
    }


def test_a_study_survives_a_killed_server_a_collapsing_trial_and_a_killed_runner(tmp_path):
    """Three trials one after another. t000's server is SIGKILLed mid-run: it is resumed from its
    checkpoint and finishes. t001 (lr 1.0) collapses and is stopped early with the reason. The
    runner is SIGKILLed while t002 trains and started again: t000 and t001 are not run again
    (their state dirs are untouched), t002's processes are re-attached, and the report holds the
    leaderboard, the plots and the best configuration."""
    study = study_file(tmp_path, '"server.lr" = [1e-3, 1.0, 7e-4]')
    out, log = tmp_path / "out", tmp_path / "runner.log"
    runner = start_runner(study, out, log)
    try:
        wait_for("t000 to train", lambda: record(out, "t000")["episodes"] >= 500, runner, log)
        killed = record(out, "t000")["server_pid"]
        os.kill(killed, signal.SIGKILL)
        wait_for("t000 to finish", lambda: record(out, "t000")["phase"] == "done", runner, log)
        wait_for(
            "t002 to train",
            lambda: record(out, "t002")["phase"] == "training" and record(out, "t002")["episodes"] >= 300,
            runner,
            log,
        )
        before = {t: snapshot(out, t) for t in ("t000", "t001")}
        t002 = record(out, "t002")
        runner.send_signal(signal.SIGKILL)
        runner.wait(timeout=30)
        assert all(os.path.exists(f"/proc/{t002[k]}") for k in ("server_pid", "client_pid")), "trial died with runner"
        runner = start_runner(study, out, log)
        assert runner.wait(timeout=400) == 0, log.read_text()[-4000:]
    finally:
        if runner.poll() is None:
            runner.kill()
    text = log.read_text()
    t000, t001, t002 = (record(out, t) for t in ("t000", "t001", "t002"))

    assert t000["status"] == "finished" and t000["resumes"] == 1 and t000["server_starts"] == 2, t000
    assert any("server died" in e for e in t000["events"]), t000["events"]
    assert t000["episodes"] >= 1400 and t000["metric"] is not None
    assert (out / "trials" / "t000" / "server.log").read_text().count(" up --config ") == 2
    assert t001["status"] == "stopped" and t001["reason"].startswith("collapse:"), t001
    assert t001["episodes"] < 1400 and t001["metric"] is not None and t001["metric"] < 0.2
    # after the runner's restart: the finished trials untouched, t002 re-attached (one server, one client)
    assert "continuing the study" in text and "t002: re-attached (training; server running" in text, text
    for trial_id, seen in before.items():
        assert snapshot(out, trial_id) == seen, f"{trial_id} changed after the runner's restart"
    # t002 runs to its end on the processes the first runner started (a real collapse may end it
    # early: lr 2e-3 did once, from 0.5 to 0)
    assert t002["server_starts"] == 1 and t002["client_starts"] == 1 and t002["resumes"] == 0, t002
    assert (t002["status"] == "finished" and t002["episodes"] >= 1400) or t002["reason"].startswith("collapse:"), t002

    report = (out / "report.md").read_text()
    for trial_id in ("t000", "t001", "t002"):
        assert f"| {trial_id} |" in report
    assert "stopped: collapse:" in report and "## Best configuration" in report
    for name in ("reward_vs_episodes.png", "reward_vs_time.png", "metric_vs_server.lr.png"):
        png = out / "plots" / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000, name
        assert f"(plots/{name})" in report
    best = tomllib.loads((out / "best-server.toml").read_text())
    winner = max((t000, t002), key=lambda t: t["metric"])
    assert best["lr"] == winner["settings"]["server.lr"] and best["batch_groups"] == 4
    trained = Path(best["model"])  # the winner's trained weights, not the initial model
    assert trained.parts[-6:-3] == ("trials", winner["id"], "state") and (trained / "config.json").exists()
    assert "serve its trained weights" in (out / "best-server.toml").read_text()
    status = subprocess.run([*CLIENT, "research", "status", str(out)], capture_output=True, text=True, timeout=60)
    assert status.returncode == 0 and "3/3 trials done" in status.stdout and "runner finished" in status.stdout
    assert "stopped" in status.stdout and "collapse: " in status.stdout


def test_halving_continues_the_best_trial_from_its_checkpoint_and_ctrl_c_resumes(tmp_path):
    """Successive halving over two learning rates: after the first rung the better trial is
    resumed from its checkpoint (``--resume``) and trained to twice the episodes; the other is
    not promoted. Ctrl-C during the second rung stops its server with a checkpoint; the same
    command continues it to the end."""
    study = study_file(
        tmp_path,
        '"server.lr" = [2e-3, 1e-5]',
        trial="episodes = 500",
        extra='search = "halving"\neta = 2\nrungs = 2',
    )
    out, log = tmp_path / "out", tmp_path / "runner.log"
    runner = start_runner(study, out, log)

    def promoted() -> str | None:
        return next((t for t in ("t000", "t001") if record(out, t)["rung"] == 1), None)

    try:
        wait_for("the second rung", lambda: promoted() is not None, runner, log)
        best = promoted()
        assert best is not None
        wait_for(f"{best} to train again", lambda: record(out, best)["phase"] == "training", runner, log)
        runner.send_signal(signal.SIGINT)
        assert runner.wait(timeout=200) == 130, log.read_text()[-4000:]
        interrupted = record(out, best)
        assert interrupted["phase"] == "interrupted" and interrupted["server_pid"] is None, interrupted
        runner = start_runner(study, out, log)
        assert runner.wait(timeout=400) == 0, log.read_text()[-4000:]
    finally:
        if runner.poll() is None:
            runner.kill()
    other = "t001" if best == "t000" else "t000"
    winner, loser = record(out, best), record(out, other)
    assert winner["rung"] == 1 and winner["target_episodes"] == 1000 and winner["episodes"] >= 1000, winner
    assert winner["status"] == "finished" and winner["server_starts"] == 3, winner  # rung 0, rung 1, after Ctrl-C
    assert winner["resumes"] == 0  # a promotion and an interruption are not crashes
    assert loser["rung"] == 0 and loser["episodes"] < 1000 and loser["phase"] == "done", loser
    assert "not promoted past rung 0" in loser["reason"] or loser["status"] != "finished", loser
    log_text = log.read_text()
    assert f"halving: rung 1 continues {best}" in log_text and "interrupted: stopping the running trials" in log_text
    starts = [line for line in (out / "trials" / best / "server.log").read_text().splitlines() if line.startswith("# ")]
    assert sum("--resume" in line for line in starts) == 2, starts  # the command lines of its starts


def test_refused_settings_fail_one_trial_and_the_time_budgets_end_the_others(tmp_path):
    """A trial whose server refuses its settings (lr -1) fails at once with the server's message;
    the next runs into its own time budget (finished, "time budget"); the study's total budget then
    stops what runs and skips what has not started."""
    study = study_file(
        tmp_path,
        '"server.lr" = [-1.0, 1e-3, 2e-3]',
        # 21 s a trial: a server and a client start in it and still train (a 12 s budget under a loaded CI
        # left none); the study's 42 s stop the third trial (the first fails at once, the second takes 21 s)
        trial="episodes = 1000000\nminutes = 0.35",
        extra="total_minutes = 0.7",
    )
    out, log = tmp_path / "out", tmp_path / "runner.log"
    runner = start_runner(study, out, log)
    try:
        assert runner.wait(timeout=300) == 0, log.read_text()[-4000:]
    finally:
        if runner.poll() is None:
            runner.kill()
    refused, timed, last = (record(out, t) for t in ("t000", "t001", "t002"))
    assert refused["status"] == "failed" and refused["server_starts"] == 1, refused
    assert refused["reason"].startswith("its server refused the settings") and "--lr" in refused["reason"], refused
    assert timed["status"] == "finished" and timed["reason"].startswith("time budget: 0.35 min"), timed
    assert timed["metric"] is not None and 0 < timed["episodes"] < 1000000
    assert last["phase"] == "done" and "the study's budget (0.7 min) ran out" in last["reason"], last
    assert last["status"] in ("stopped", "skipped")
    report = (out / "report.md").read_text()
    assert "failed: its server refused the settings" in report and "best-server.toml" in report


def test_a_study_whose_every_trial_failed_exits_non_zero(tmp_path):
    study = study_file(tmp_path, '"server.lr" = [-1.0, -2.0]')  # refused by every trial's server
    out = tmp_path / "out"
    env = {**os.environ, "AGENTJET_CACHE_DIR": str(CACHE)}
    command = [*CLIENT, "research", "run", str(study), "--out", str(out)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "every trial failed" in " ".join(proc.stderr.split()) and "t000: its server refused" in proc.stderr


def test_a_trial_that_crashes_more_often_than_max_resumes_fails_and_the_study_goes_on(tmp_path):
    """``max_resumes = 0``: the first SIGKILL of t000's server fails the trial, with the reason and
    its processes gone; t001 runs as if nothing happened."""
    study = study_file(tmp_path, '"server.lr" = [1e-3, 7e-4]', trial="episodes = 600", extra="max_resumes = 0")
    out, log = tmp_path / "out", tmp_path / "runner.log"
    runner = start_runner(study, out, log)
    try:
        wait_for("t000 to train", lambda: record(out, "t000")["episodes"] >= 200, runner, log)
        crashed = record(out, "t000")
        os.kill(crashed["server_pid"], signal.SIGKILL)
        assert runner.wait(timeout=300) == 0, log.read_text()[-4000:]
    finally:
        if runner.poll() is None:
            runner.kill()
    failed, other = record(out, "t000"), record(out, "t001")
    assert failed["status"] == "failed" and failed["server_starts"] == 1, failed
    assert failed["reason"].startswith("its server died (exit -9") and "0 resume(s) did not help" in failed["reason"]
    assert (
        not os.path.exists(f"/proc/{crashed['client_pid']}")
        or "Z" in Path(f"/proc/{crashed['client_pid']}/stat").read_text().rsplit(")", 1)[1].split()[0]
    ), "the failed trial's client still runs"
    assert other["status"] == "finished" and other["episodes"] >= 600 and other["metric"] is not None, other
    assert "t000 failed: its server died" in log.read_text()


def test_a_runner_that_comes_back_to_a_trial_whose_client_died_meanwhile_starts_a_client_again(tmp_path):
    """The runner is SIGKILLed while t000 trains, and t000's client dies while no runner watches (it
    also finished unwatched once, in a kill between its last episode and the next poll): the runner that comes
    back re-attaches the server, starts a client again and the trial finishes, where it used to fail an
    assertion at every restart."""
    study = study_file(tmp_path, '"server.lr" = [1e-3]', trial="episodes = 600")
    out, log = tmp_path / "out", tmp_path / "runner.log"
    runner = start_runner(study, out, log)
    try:
        wait_for("t000 to train", lambda: record(out, "t000")["episodes"] >= 100, runner, log)
        trained = record(out, "t000")
        runner.send_signal(signal.SIGKILL)
        runner.wait(timeout=30)
        os.kill(trained["client_pid"], signal.SIGKILL)
        runner = start_runner(study, out, log)
        assert runner.wait(timeout=300) == 0, log.read_text()[-4000:]
    finally:
        if runner.poll() is None:
            runner.kill()
    done = record(out, "t000")
    assert done["status"] == "finished" and done["episodes"] >= 600, done
    assert done["server_starts"] == 1 and done["client_starts"] == 2, done  # the same server, a second client
    assert "Traceback" not in log.read_text() and "t000: re-attached (training; server running" in log.read_text()


def metrics_lines(out: Path, trial_id: str, kind: str) -> list[dict[str, Any]]:
    """The trial server's own record (its state dir's metrics.jsonl) of one kind of line."""
    path = out / "trials" / trial_id / "state" / "metrics.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return [x for x in lines if x.get("kind") == kind]


def test_population_based_training_and_a_rule_change_trials_while_they_train(tmp_path):
    """Two trials at once, one with a learning rate too small to learn: at each ready point the worse
    takes the better's checkpoint through the admin API and explores a perturbed learning rate; a rule
    halves each trial's learning rate once. Every change is in the trial's events, changes.jsonl, the
    report and the server's own metrics.jsonl; the best configuration carries the changed settings."""
    study = study_file(tmp_path, '"server.lr" = [1e-6, 3e-3]', trial="episodes = 1600")
    with study.open("a") as f:
        f.write(
            # min_z 1: this test is about the mechanism; resample 0: explore gives the donor's values x 0.5 or 1.5
            "\n[pbt]\nevery_episodes = 400\nburn_in_episodes = 600\nquantile = 0.5\npoints = 2\n"
            "perturb = [0.5, 1.5]\nresample = 0.0\nmin_z = 1.0\n"
            '\n[[adjust]]\nwhen = "grad_norm >= 0"\nover = 2\nset = { lr = "x0.5" }\nmax_times = 1\n'
        )
    out, log = tmp_path / "out", tmp_path / "runner.log"
    runner = start_runner(study, out, log)
    try:
        assert runner.wait(timeout=600) == 0, log.read_text()[-4000:]
    finally:
        if runner.poll() is None:
            runner.kill()
    assert "population-based training runs all 2 trials at once" in log.read_text()
    changes = [json.loads(x) for x in (out / "changes.jsonl").read_text().splitlines()]
    exploits = [c for c in changes if c["kind"] == "exploit"]
    adjusts = [c for c in changes if c["kind"] == "adjust"]
    assert exploits, log.read_text()[-4000:]
    assert sorted(c["trial"] for c in adjusts) == ["t000", "t001"]  # max_times = 1 per trial
    for change in adjusts:
        assert change["after"]["lr"] == pytest.approx(change["before"]["lr"] * 0.5, rel=1e-3)
        configs = metrics_lines(out, change["trial"], "config")
        assert any(c["changes"] == {"lr": change["after"]["lr"]} for c in configs), configs
    for change in exploits:
        assert change["episodes"] >= 600  # none before the burn-in
        taker, donor = record(out, change["trial"]), change["donor"]
        assert change["donor_score"] > change["score"] and taker["exploits"] >= 1
        assert any(e.split(" ", 1)[1].startswith(f"pbt: took {donor}'s checkpoint") for e in taker["events"])
        adopted = metrics_lines(out, change["trial"], "adopt")
        assert any(f"/trials/{change['trial']}/adopted/{donor}-step-" in a["source"] for a in adopted), adopted
        lr = change["after"]["server.lr"]
        if lr != change["before"]["server.lr"]:  # an unchanged value is not a change the server records
            assert any(c["changes"] == {"lr": lr} for c in metrics_lines(out, change["trial"], "config"))
        assert not (out / "trials" / change["trial"] / "adopted" / f"{donor}-step").exists()
    last = {c["trial"]: c for c in changes}
    for trial_id in ("t000", "t001"):
        trial = record(out, trial_id)
        # a learning rate explored upwards may collapse and be stopped early: it is still evaluated
        assert trial["status"] in ("finished", "stopped") and trial["metric"] is not None, trial
        if trial_id in last:  # its settings now: what the last change left
            after = last[trial_id]["after"]
            assert trial["changed"]["server.lr"] == after.get("server.lr", after.get("lr")), trial
    report = (out / "report.md").read_text()
    assert "## Live changes" in report and f"{len(exploits)} population-based training exploit" in report
    assert "took " in report and "grad_norm" in report and "(dotted: exploits)" not in report  # a plot title
    finished = [t for t in (record(out, "t000"), record(out, "t001")) if t["status"] == "finished"]
    if finished:  # the best configuration is one that ran its budget
        winner = max(finished, key=lambda t: t["metric"])
        best = tomllib.loads((out / "best-server.toml").read_text())
        assert best["lr"] == winner["changed"].get("server.lr", winner["settings"]["server.lr"])
