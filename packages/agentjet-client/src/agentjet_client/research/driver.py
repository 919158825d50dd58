"""One trial's life, a step at a time: ``TrialDriver`` starts (or resumes) a trial's server, starts its
client once the server answers (their commands and ports: ``launch.py``), follows the run through the
server's public API (``monitor.py``) into the trial's reward series (``series.py``), ends training early
(``stopping.py``) or at its budget, runs the final evaluation, restarts what crashed (up to
``max_resumes``), and stops the server through the admin API, which writes a checkpoint. Every change is
written to the trial's ``trial.json`` before the next step; ``StudyRunner`` (``runner.py``) calls
``advance`` on each running trial every poll.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2

from agentjet_client.research.launch import client_command, free_port, server_command
from agentjet_client.research.monitor import Probe
from agentjet_client.research.series import Series, train_metric
from agentjet_client.research.stopping import stop_reason
from agentjet_client.research.study import Study, toml_text
from agentjet_client.research.trial import Process, TrialDir, TrialRecord, last_lines

STOP_WAIT_S = 120.0  # a server asked to stop that has not exited by then gets SIGTERM
UNREACHABLE_S = 60.0  # a running server that answers nothing this long is killed and resumed


@dataclass
class Live:
    """What the runner holds in memory for a running trial (rebuilt from disk after a restart)."""

    files: TrialDir
    probe: Probe
    series: Series  # its reward points, the stopping rules' input
    server: Process | None = None
    client: Process | None = None
    evaluator: Process | None = None
    unreachable_since: float | None = None
    phase_since: float = field(default_factory=time.monotonic)


class TrialDriver:
    """Drives the study's trials; ``live`` holds what runs now, by trial id."""

    def __init__(
        self, study: Study, study_path: Path, out: Path, server_command: list[str], say: Callable[[str], None]
    ) -> None:
        self.study, self.study_path, self.out = study, study_path, out
        self.say = say
        self.live: dict[str, Live] = {}
        self.parallel = 1  # trials at once: each server gets its share of the cores
        self._server_command = server_command

    def open(self, record: TrialRecord) -> Live:
        files = TrialDir(self.out, record.id)
        series = Series.load(files, self.study.stop.window, record)
        live = Live(files, Probe(f"http://127.0.0.1:{record.port}"), series)
        self.live[record.id] = live
        return live

    def start(self, record: TrialRecord) -> None:
        """Start (or resume) a pending or interrupted trial's server."""
        files = TrialDir(self.out, record.id)
        files.path.mkdir(parents=True, exist_ok=True)
        resume = record.server_starts > 0
        if record.port is None:  # a resumed trial keeps its port: its client (and its spool) know that URL
            record.port = free_port()
        if not resume:
            files.server_config.write_text(toml_text(self.study.server_settings(record.settings)))
            record.started_at = time.time()
            self.say(f"{record.id} starts: {describe(record.settings)}")
        else:
            self.say(f"{record.id} resumes from its checkpoint (rung {record.rung}, {record.target_episodes} episodes)")
        if record.phase == "pending":
            record.after_start = "training"
        if record.status is None:  # one interrupted while evaluating keeps how its training ended
            record.status = "running"
        record.run_started_at = time.time()
        live = self.live.get(record.id) or self.open(record)
        live.probe.close()
        live.probe = Probe(f"http://127.0.0.1:{record.port}")
        self._spawn_server(record, live, resume)

    def _spawn_server(self, record: TrialRecord, live: Live, resume: bool) -> None:
        files = live.files
        command, env = server_command(self._server_command, self.study, record, files, resume, self.parallel)
        live.server = Process.spawn(command, files.server_log, env, str(files.path))
        record.server_pid = live.server.pid
        record.server_starts += 1
        record.phase = "starting"
        live.phase_since = time.monotonic()
        files.save(record)

    def _spawn_client(self, record: TrialRecord, live: Live, evaluation: bool = False) -> Process:
        command, env = client_command(self.study, self.study_path, record, live.files, evaluation)
        return Process.spawn(
            command, live.files.eval_log if evaluation else live.files.client_log, env, str(live.files.path)
        )

    def advance(self, record: TrialRecord, live: Live) -> None:
        if record.phase == "stopping":
            self._await_exit(record, live)
            return
        code = live.server.returncode() if live.server is not None else -1
        if code is not None:
            self._server_died(record, live, code)
            return
        if record.phase == "starting":
            if live.probe.healthy():
                self._started(record, live)
            elif time.monotonic() - live.phase_since > self.study.trial.start_timeout_s:
                record.note(f"no answer within {self.study.trial.start_timeout_s:.0f}s of starting")
                assert live.server is not None
                live.server.end(signal.SIGKILL, 0)
            return
        try:
            observation = live.probe.observe(record.history_seq)
        except (httpx2.HTTPError, ValueError):
            now = time.monotonic()
            live.unreachable_since = live.unreachable_since or now
            if now - live.unreachable_since > UNREACHABLE_S:
                record.note(f"its server answered nothing for {UNREACHABLE_S:.0f}s: killed, to be resumed")
                assert live.server is not None
                live.server.end(signal.SIGKILL, 0)
            return
        live.unreachable_since = None
        live.series.observe(record, observation)
        if record.phase == "training":
            self._check_training(record, live)
        elif record.phase == "evaluating":
            self._check_evaluation(record, live)

    def _started(self, record: TrialRecord, live: Live) -> None:
        record.phase = record.after_start
        live.phase_since = time.monotonic()
        if record.phase == "training" and (live.client is None or live.client.returncode() is not None):
            self._start_client(record, live)
        elif record.phase == "evaluating":
            self._spawn_evaluation(record, live)
        live.files.save(record)

    def _start_client(self, record: TrialRecord, live: Live) -> None:
        live.client = self._spawn_client(record, live)
        record.client_pid = live.client.pid
        record.client_starts += 1

    def _check_training(self, record: TrialRecord, live: Live) -> None:
        reason = stop_reason(self.study.stop, live.series.train, live.series.evals, live.series.steps)
        minutes = self.study.trial.minutes
        if reason is not None:
            self.end_training(record, live, "stopped", reason)
            return
        if minutes is not None and record.seconds() >= minutes * 60:
            self.end_training(record, live, "finished", f"time budget: {minutes:g} min, {record.episodes} episodes")
            return
        # None: re-attached with its client gone, which a runner killed at the wrong moment leaves (the client
        # finished, or died, while no runner watched): read like a client that is not ours to reap
        code = live.client.returncode() if live.client is not None else -1
        if code is None:
            return
        tail = last_lines(live.files.client_log, 6)
        if code == 0 or (code == -1 and "done:" in tail and "interrupted" not in tail):  # -1: not ours to reap
            try:  # what the client delivered since this round's poll
                live.series.observe(record, live.probe.observe(record.history_seq))
            except (httpx2.HTTPError, ValueError):
                pass
            self.end_training(record, live, "finished", f"budget: {record.episodes} episodes")
            return
        if not self._crashed(record, live, f"its client exited ({code})", live.files.client_log, "restarted"):
            return
        self._start_client(record, live)
        live.files.save(record)

    def end_training(self, record: TrialRecord, live: Live, status: str, reason: str) -> None:
        if live.client is not None:
            live.client.end(signal.SIGINT, 15.0)
        live.series.flush_rounds(keep_last=False)
        record.status = status  # type: ignore[assignment]
        record.reason = reason
        record.note(reason)
        self.say(f"{record.id} {'stopped early' if status == 'stopped' else 'trained'}: {reason}")
        if self.study.study.metric == "eval_reward":
            self._spawn_evaluation(record, live)
        else:
            record.metric = train_metric(live.series.train)
            self._stop_server(record, live)
        live.files.save(record)

    def _spawn_evaluation(self, record: TrialRecord, live: Live) -> None:
        try:  # the final round's episodes are the evaluation lines after this one
            _, record.eval_from_seq = live.probe.history(record.history_seq, "eval")
        except (httpx2.HTTPError, ValueError):
            record.eval_from_seq = record.history_seq
        live.evaluator = self._spawn_client(record, live, evaluation=True)
        record.eval_pid = live.evaluator.pid
        record.phase = "evaluating"
        record.after_start = "evaluating"
        live.phase_since = time.monotonic()

    def _check_evaluation(self, record: TrialRecord, live: Live) -> None:
        code = live.evaluator.returncode() if live.evaluator is not None else -1  # None: gone, as in training
        if code is None:
            return
        try:
            lines, _ = live.probe.history(record.eval_from_seq, "eval")
        except (httpx2.HTTPError, ValueError):
            return  # asked again next round
        if live.series.final(record, lines):
            self._stop_server(record, live)
            return
        what = f"the final evaluation recorded nothing (exit {code})"
        if not self._crashed(record, live, what, live.files.eval_log, "run again"):
            return
        self._spawn_evaluation(record, live)
        live.files.save(record)

    def _stop_server(self, record: TrialRecord, live: Live) -> None:
        try:
            message = live.probe.stop()
            record.note(f"stopped through the admin API: {message}")
        except (httpx2.HTTPError, ValueError) as exc:
            record.note(f"the admin stop failed ({exc}); SIGTERM (the server checkpoints on it)")
            if live.server is not None:
                live.server.send(signal.SIGTERM)
        record.phase = "stopping"
        live.phase_since = time.monotonic()
        live.files.save(record)

    def _await_exit(self, record: TrialRecord, live: Live) -> None:
        if live.server is not None and live.server.returncode() is None:
            if time.monotonic() - live.phase_since > STOP_WAIT_S:
                live.server.end(signal.SIGTERM, 30.0)
            return
        self.done(record)

    def _server_died(self, record: TrialRecord, live: Live, code: int) -> None:
        log = last_lines(live.files.server_log)
        if record.phase == "starting" and record.server_starts == 1 and code == 2:  # `up` refused the settings
            self._fail(record, live, f"its server refused the settings: {log}")
            return
        what = f"its server died ({'exit ' + str(code) if code != -1 else 'gone'})"
        if not self._crashed(record, live, what, live.files.server_log, "resumed with --resume"):
            return
        if record.phase == "evaluating" and live.evaluator is not None:
            live.evaluator.end(signal.SIGKILL, 0)  # the round is run again once the server is back
        if record.phase in ("training", "evaluating"):
            record.after_start = record.phase
        self._spawn_server(record, live, resume=True)  # the client keeps its episodes in its spool meanwhile

    def _crashed(self, record: TrialRecord, live: Live, what: str, log: Path, recovery: str) -> bool:
        """Count a crash (``what``, with the last lines of ``log``); False, and the trial failed,
        once there were more than ``max_resumes``."""
        record.resumes += 1
        limit = self.study.study.max_resumes
        detail = f"{what}; log: {last_lines(log)}"
        if record.resumes > limit:
            self._fail(record, live, f"{detail}; {limit} resume(s) did not help")
            return False
        record.note(f"{detail}; {recovery} ({record.resumes}/{limit})")
        self.say(f"{record.id}: {what}; {recovery} ({record.resumes}/{limit})")
        return True

    def _fail(self, record: TrialRecord, live: Live, reason: str) -> None:
        for process in (live.client, live.evaluator):
            if process is not None:
                process.end(signal.SIGKILL, 0)
        if live.server is not None:
            live.server.end(signal.SIGTERM, 30.0)
        record.status = "failed"
        record.reason = reason
        record.note("failed: " + reason)
        self.say(f"{record.id} failed: {reason}")
        self.done(record)

    def done(self, record: TrialRecord) -> None:
        record.phase = "done"
        record.ended_at = time.time()
        if record.run_started_at is not None:
            record.active_s += record.ended_at - record.run_started_at
            record.run_started_at = None
        record.server_pid = record.client_pid = record.eval_pid = None
        TrialDir(self.out, record.id).save(record)


def describe(settings: dict[str, Any]) -> str:
    return "  ".join(f"{k}={v}" for k, v in settings.items())
