"""A study on disk, and the processes its trials run.

The runner's own state is ``OUT/study.json`` (``StudyState``: the trial ids in order, how many run
at once, the halving rung, the runner's pid and running time). Everything a trial is lives under
``OUT/trials/<id>/``::

    trial.json      the record below, rewritten atomically at every change of phase
    server.toml     its `agentjet-server up` job file (the study's [server] + the trial's settings)
    state/          the server's --state-dir: trajectory log, checkpoints, metrics.jsonl
    spool/          the client's durable outbox (a restarted client sends what is left first)
    series.jsonl    reward points as the runner saw them ({"kind": "train" | "eval", ...})
    server.log, client.log, eval.log    the processes' output

A trial's life: ``pending`` -> ``starting`` (its server is coming up) -> ``training`` (its client
runs) -> ``evaluating`` (a final evaluation round) -> ``stopping`` (the admin API's stop writes a
checkpoint) -> ``done``, with ``status`` saying how it ended: finished (its budget), stopped
(early: the reason says which rule), failed (crashed more than ``max_resumes`` times, or refused
to start) or skipped (the study's total budget ran out first). A server or client that dies is
restarted (the server with ``--resume``) and the phase carries on.

Processes start in their own session, so a runner that dies (even by SIGKILL) leaves them running:
a restarted runner finds them by the pid in ``trial.json`` and re-attaches. A pid is only trusted
while ``/proc/<pid>/cmdline`` still names the trial's directory.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from filelock import FileLock, Timeout
from pydantic import BaseModel, Field

from agentjet_client.errors import StudyError

Phase = Literal["pending", "starting", "training", "evaluating", "stopping", "interrupted", "done"]
Status = Literal["running", "finished", "stopped", "failed", "skipped"]


class StudyState(BaseModel):
    """``DIR/study.json``: the runner's own state."""

    name: str
    study_file: str
    study_hash: str
    trials: list[str]
    parallel: int
    parallel_reason: str
    rung: int = 0
    created_at: float = Field(default_factory=time.time)
    active_s: float = 0.0  # the runner's running time before the current start
    runner_pid: int | None = None
    runner_started_at: float | None = None
    saved_at: float = 0.0  # when the runner last wrote this (a killed runner's time counts up to it)
    finished_at: float | None = None

    def seconds(self, now: float | None = None) -> float:
        if self.runner_started_at is None:
            return self.active_s
        return self.active_s + ((now or time.time()) - self.runner_started_at)


def load_state(out: Path) -> StudyState:
    return StudyState.model_validate_json((out / "study.json").read_text())


class TrialRecord(BaseModel):
    id: str
    index: int
    settings: dict[str, Any]  # the searched settings ({"server.lr": 0.001, ...})
    phase: Phase = "pending"
    status: Status | None = None
    reason: str | None = None  # why it ended (or why it failed)
    metric: float | None = None
    rung: int = 0  # successive halving: the round it is in
    target_episodes: int = 0
    port: int | None = None
    server_pid: int | None = None
    client_pid: int | None = None
    eval_pid: int | None = None
    after_start: Literal["training", "evaluating"] = "training"  # the phase a (re)started server goes back to
    server_starts: int = 0
    client_starts: int = 0
    resumes: int = 0  # crashes recovered (server restarted with --resume, or client restarted)
    started_at: float | None = None  # wall clock of the first start
    run_started_at: float | None = None  # wall clock of the start of the current stretch of running
    active_s: float = 0.0  # running time of the stretches before the current one
    ended_at: float | None = None
    episodes: int = 0  # training episodes the server accepted
    eval_from_seq: int = 0  # the history line after which the final evaluation's episodes count
    history_seq: int = 0  # the last metrics-history line read
    window: dict[str, float] = Field(default_factory=dict)  # the reward window's state
    last_reward: float | None = None
    events: list[str] = Field(default_factory=list)
    # changed while it trained (``live.py``): server settings now (server.NAME -> value), population-based
    # training's cursor (episodes at its last ready check, first training point of its score, exploits)
    # and each [[adjust]] rule's firings and the step its next reading starts after
    changed: dict[str, Any] = Field(default_factory=dict)
    pbt_ready_at: int = 0
    scored_from: int = 0
    exploits: int = 0
    rules: dict[str, dict[str, int]] = Field(default_factory=dict)

    def current(self) -> dict[str, Any]:
        """The searched settings as they are now (the study's, with what changed while it trained)."""
        return {**self.settings, **self.changed}

    def seconds(self, now: float | None = None) -> float:
        """Running time: earlier stretches plus the current one."""
        if self.run_started_at is None:
            return self.active_s
        return self.active_s + ((now or time.time()) - self.run_started_at)

    def note(self, message: str) -> None:
        self.events.append(f"{time.strftime('%H:%M:%S')} {message}")
        del self.events[:-50]


class TrialDir:
    """The files of one trial."""

    def __init__(self, root: Path, trial_id: str) -> None:
        self.path = root / "trials" / trial_id
        self.record_path = self.path / "trial.json"
        self.server_config = self.path / "server.toml"
        self.state = self.path / "state"
        self.spool = self.path / "spool"
        self.series = self.path / "series.jsonl"
        self.server_log = self.path / "server.log"
        self.client_log = self.path / "client.log"
        self.eval_log = self.path / "eval.log"

    def load(self) -> TrialRecord:
        return TrialRecord.model_validate_json(self.record_path.read_text())

    def save(self, record: TrialRecord) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        write_atomic(self.record_path, record.model_dump_json(indent=1))

    def append_point(self, kind: str, point: dict[str, Any]) -> None:
        with self.series.open("a") as f:
            f.write(json.dumps({"kind": kind, **point}) + "\n")

    def points(self) -> list[dict[str, Any]]:
        if not self.series.exists():
            return []
        out = []
        for line in self.series.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by a crash
                continue
        return out


class RunnerLock:
    """The lock a study's runner holds while it runs (``OUT/runner.lock``, a ``filelock`` lock: it goes with
    the process, even on SIGKILL): one runner per study directory. Who holds it is in ``OUT/runner.pid``
    (the lock file itself is truncated by every try to take it)."""

    def __init__(self, out: Path) -> None:
        self.path = out / "runner.lock"
        self.holder = out / "runner.pid"
        self._lock: FileLock | None = None

    def take(self) -> None:
        lock = FileLock(self.path)
        try:
            lock.acquire(timeout=0)  # one try: a runner holds it, or it is ours
        except Timeout:
            try:
                holder = self.holder.read_text().strip() or "another process"
            except OSError:
                holder = "another process"
            raise StudyError(
                f"another runner ({holder}) is running the study in {self.path.parent}; watch it with "
                f"`agentjet-client research status {self.path.parent}`"
            ) from None
        self.holder.write_text(f"pid {os.getpid()}")
        self._lock = lock

    def release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def held_elsewhere(self) -> bool:
        """Whether a runner holds it now."""
        if not self.path.exists():
            return False
        probe = FileLock(self.path)
        try:
            probe.acquire(timeout=0)
        except Timeout:
            return True
        probe.release()
        return False


def write_atomic(path: Path, text: str) -> None:
    """``text`` in ``path``, whole or not at all (a crash leaves the old file)."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class Process:
    """A trial's child process: spawned here (``Popen``, reaped here) or found again by pid."""

    def __init__(self, pid: int, marker: str, popen: subprocess.Popen[bytes] | None = None) -> None:
        self.pid = pid
        self.marker = marker  # a string its command line holds (the trial's directory)
        self.popen = popen

    @classmethod
    def spawn(
        cls,
        command: list[str],
        log: Path,
        env: dict[str, str],
        marker: str,
        cwd: str | None = None,
        preexec: Callable[[], None] | None = None,
    ) -> Process:
        """``command`` in a session of its own (it outlives this process), its output appended to
        ``log``; ``preexec`` runs in the child before exec (default: SIGINT and SIGTERM back to
        their defaults)."""
        with log.open("ab") as out:
            out.write(f"\n# {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(command)}\n".encode())
            out.flush()
            popen = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=cwd,
                start_new_session=True,
                preexec_fn=preexec or default_signals,
            )
        return cls(popen.pid, marker, popen)

    def returncode(self) -> int | None:
        """The exit code once it has exited (-1 when it was not ours to reap), else None."""
        if self.popen is not None:
            return self.popen.poll()
        return None if pid_alive(self.pid, self.marker) else -1

    def send(self, sig: int) -> None:
        if self.returncode() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def end(self, first: int = signal.SIGTERM, grace: float = 30.0) -> None:
        """``first`` signal, then SIGKILL after ``grace`` seconds."""
        self.send(first)
        deadline = time.monotonic() + grace
        while self.returncode() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if self.returncode() is None:
            self.send(signal.SIGKILL)
            deadline = time.monotonic() + 10
            while self.returncode() is None and time.monotonic() < deadline:
                time.sleep(0.1)


def default_signals() -> None:
    """In the child before exec: SIGINT and SIGTERM back to their defaults. A runner started in
    the background of a shell ignores SIGINT, and an ignored signal stays ignored across exec: the
    client would never see the SIGINT that asks it to stop."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def pid_alive(pid: int, marker: str) -> bool:
    """``pid`` runs and is still the process we started (its command line holds ``marker``)."""
    proc = Path(f"/proc/{pid}")
    if proc.parent.exists():
        try:
            if (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return False  # exited, not yet reaped by its new parent
            return marker in (proc / "cmdline").read_bytes().decode(errors="replace")
        except (OSError, IndexError):
            return False
    try:  # no /proc (macOS): the pid alone
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def last_lines(path: Path, count: int = 3, width: int = 300) -> str:
    """The last non-empty lines of a log, for a failure's reason."""
    try:
        lines = [x.strip() for x in path.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return "(no log)"
    return " | ".join(line[:width] for line in lines[-count:]) or "(empty log)"
