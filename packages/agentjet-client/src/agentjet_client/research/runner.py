"""The study runner: ``agentjet-client research run STUDY.toml --out DIR``.

It plans the trials (``study.py``), runs as many at once as the machine holds, each as its own
``agentjet-server up`` (own port and state dir) and ``agentjet-client run``, follows each through
the server's public API (``monitor.py``), ends trials early (``stopping.py``), resumes crashed ones,
evaluates each at the end of its budget, stops its server through the admin API (which writes a
checkpoint), and writes the report (``report.py``) as trials finish.

Nothing lives only in the runner's memory: ``DIR/study.json`` and every ``trial.json`` are
rewritten at each change, and trial processes run in sessions of their own. Killed (even by
SIGKILL) and started again with the same ``--out``, the runner keeps finished trials as they are,
re-attaches to trial processes that are still running, and resumes the others from their
checkpoints. Ctrl-C stops every running trial with a checkpoint first; the same command continues.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx2

from agentjet_client.errors import StudyError
from agentjet_client.research.driver import STOP_WAIT_S, TrialDriver
from agentjet_client.research.live import LiveTuner
from agentjet_client.research.report import write_report
from agentjet_client.research.study import load_study, machine_parallel
from agentjet_client.research.trial import (
    Process,
    RunnerLock,
    StudyState,
    TrialDir,
    TrialRecord,
    load_state,
    pid_alive,
    write_atomic,
)


class StudyRunner:
    def __init__(
        self,
        study_path: Path,
        out: Path,
        say: Callable[[str], None] = print,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.study_path = study_path.resolve()
        self.study, self.study_hash = load_study(self.study_path)
        self.out = out.resolve()
        self.say = say
        self.sleep = sleep
        self.records: dict[str, TrialRecord] = {}
        self.state: StudyState | None = None
        self._lock = RunnerLock(self.out)
        self.driver = TrialDriver(self.study, self.study_path, self.out, _resolve(self.study.study.server_command), say)
        self.live = self.driver.live
        self.tuner = LiveTuner(self.study, self.out, say)

    # -- the loop ---------------------------------------------------------------------------------
    def run(self) -> StudyState:
        self.out.mkdir(parents=True, exist_ok=True)
        self._lock.take()
        # SIGINT too: a runner started in a shell's background inherits it ignored, and a
        # `kill -INT` should still stop the study with checkpoints
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
        for sig in previous:
            signal.signal(sig, _raise_interrupt)
        try:
            state = self._open()
            self._attach()
            try:
                while self._tick(state):
                    self.sleep(self.study.study.poll_seconds)
            except KeyboardInterrupt:
                self._interrupt(state)
                raise
            state.finished_at = time.time()
            self._save_state(state, running=False)
            self.write_report()
            return state
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            for live in self.live.values():
                live.probe.close()
            self._lock.release()

    def _tick(self, state: StudyState) -> bool:
        """One round over every trial; False once the study is done."""
        for trial_id in list(self.live):
            record = self.records[trial_id]
            self.driver.advance(record, self.live[trial_id])
            if record.phase == "done":
                self.live.pop(trial_id).probe.close()
                self._finished(record)
        self.tuner.tick(self.records, self.live)
        self._promote(state)
        limit = self.study.study.total_minutes
        if limit is not None and state.seconds() >= limit * 60:
            self._out_of_budget(limit)
        pending = [r for r in self.records.values() if r.phase in ("pending", "interrupted")]
        for record in pending[: max(0, state.parallel - len(self.live))]:
            self.driver.start(record)
        self._save_state(state)
        return bool(self.live) or any(r.phase != "done" for r in self.records.values())

    # -- opening, re-attaching --------------------------------------------------------------------
    def _open(self) -> StudyState:
        path = self.out / "study.json"
        if path.exists():
            state = load_state(self.out)
            if state.study_hash != self.study_hash:
                raise StudyError(
                    f"{self.out} holds the study from {state.study_file} as it was then, and {self.study_path} "
                    f"has changed since (or is another study); give a new --out, or restore the file "
                    f"(its copy is {self.out / 'study.toml'})"
                )
            if state.runner_started_at is not None:  # the last runner was killed: count its time up to its last save
                state.active_s += max(0.0, state.saved_at - state.runner_started_at)
            for trial_id in state.trials:
                self.records[trial_id] = TrialDir(self.out, trial_id).load()
            done = sum(r.phase == "done" for r in self.records.values())
            self.say(f"continuing the study in {self.out}: {done} of {len(state.trials)} trials done")
        else:
            configurations = self.study.configurations()
            parallel, why = machine_parallel(self.study.study, len(configurations) if self.study.pbt else None)
            ids = [f"t{i:03d}" for i in range(len(configurations))]
            state = StudyState(
                name=self.study.study.name,
                study_file=str(self.study_path),
                study_hash=self.study_hash,
                trials=ids,
                parallel=parallel,
                parallel_reason=why,
            )
            shutil.copyfile(self.study_path, self.out / "study.toml")
            for index, (trial_id, settings) in enumerate(zip(ids, configurations, strict=True)):
                record = TrialRecord(
                    id=trial_id, index=index, settings=settings, target_episodes=self.study.trial.episodes
                )
                self.records[trial_id] = record
                TrialDir(self.out, trial_id).save(record)
            what = self.study.study.search + (
                f", {self.study.study.rungs} rungs, eta {self.study.study.eta}"
                if self.study.study.search == "halving"
                else ""
            )
            self.say(f"study '{state.name}': {len(ids)} trials ({what}), metric {self.study.study.metric}")
        self.say(f"{state.parallel} trial(s) at once ({state.parallel_reason})")
        state.runner_pid = os.getpid()
        state.runner_started_at = time.time()
        self.state = state
        self.driver.parallel = state.parallel
        self._save_state(state)
        return state

    def _attach(self) -> None:
        """Trials a killed runner left mid-way: their processes, if still theirs, or a resume."""
        for record in self.records.values():
            if record.phase in ("pending", "done", "interrupted"):
                continue
            live = self.driver.open(record)
            marker = str(live.files.path)
            for name in ("server", "client", "evaluator"):
                pid = getattr(record, f"{'eval' if name == 'evaluator' else name}_pid")
                if pid is not None and pid_alive(pid, marker):
                    setattr(live, name, Process(pid, marker))
            if live.server is None:
                record.note("its server was gone when the runner came back")
            self.say(
                f"{record.id}: re-attached ({record.phase}; server "
                f"{'running, pid ' + str(record.server_pid) if live.server else 'gone'})"
            )

    def _finished(self, record: TrialRecord) -> None:
        metric = f"{self.study.study.metric} {record.metric:.3f}" if record.metric is not None else "no metric"
        self.say(f"{record.id} {record.status}: {metric} ({record.seconds():.0f}s, {record.episodes} episodes)")
        self.write_report()

    # -- study-wide -------------------------------------------------------------------------------
    def _promote(self, state: StudyState) -> None:
        """Successive halving: once every trial of the current rung is done, continue the best
        1/eta of those that finished (not stopped early, not failed) on eta times the episodes."""
        study = self.study.study
        if study.search != "halving" or state.rung + 1 >= study.rungs:
            return
        members = [r for r in self.records.values() if r.rung == state.rung and r.status != "skipped"]
        if not members or any(r.phase != "done" for r in members):
            return
        ranked = sorted(
            (r for r in members if r.status == "finished" and r.metric is not None),
            key=lambda r: r.metric or 0.0,
            reverse=True,
        )
        keep = ranked[: max(1, math.ceil(len(members) / study.eta))]
        state.rung += 1
        target = self.study.trial.episodes * study.eta**state.rung
        for record in members:
            if record in keep:
                record.rung = state.rung
                record.target_episodes = target
                record.phase = "interrupted"  # resumed from its checkpoint by the next tick
                record.after_start = "training"
                record.status = None
                record.note(f"promoted to rung {state.rung} ({target} episodes in all)")
            else:
                record.reason = f"{record.reason}; not promoted past rung {state.rung - 1}"
            TrialDir(self.out, record.id).save(record)
        self.say(f"halving: rung {state.rung} continues {', '.join(r.id for r in keep)} to {target} episodes")

    def _out_of_budget(self, limit: float) -> None:
        for record in self.records.values():
            if record.phase in ("pending", "interrupted"):
                fresh = record.server_starts == 0
                record.status = "skipped" if fresh else "stopped"
                when = "started" if fresh else "resumed"
                record.reason = f"the study's budget ({limit:g} min) ran out before it {when}"
                self.driver.done(record)
            elif record.phase in ("starting", "training") and record.id in self.live:
                live = self.live[record.id]
                if record.phase == "starting":  # evaluated once its server answers
                    if record.after_start == "training":
                        record.after_start = "evaluating"
                        record.status = "stopped"
                        record.reason = f"the study's budget ({limit:g} min) ran out"
                    continue
                self.driver.end_training(record, live, "stopped", f"the study's budget ({limit:g} min) ran out")

    def _interrupt(self, state: StudyState) -> None:
        self.say("interrupted: stopping the running trials with a checkpoint each")
        for trial_id, live in self.live.items():
            record = self.records[trial_id]
            for process in (live.client, live.evaluator):
                if process is not None:
                    process.end(signal.SIGINT, 15.0)
            if live.server is not None and live.server.returncode() is None:
                try:
                    live.probe.stop()
                except (httpx2.HTTPError, ValueError):
                    live.server.send(signal.SIGTERM)
                live.server.end(signal.SIGTERM, STOP_WAIT_S)
            if record.phase in ("starting", "training", "evaluating"):
                record.after_start = "evaluating" if record.phase == "evaluating" else record.after_start
                record.phase = "interrupted"
            if record.run_started_at is not None:
                record.active_s += time.time() - record.run_started_at
                record.run_started_at = None
            record.server_pid = record.client_pid = record.eval_pid = None
            record.note("interrupted with the runner")
            live.files.save(record)
        self._save_state(state, running=False)
        self.say(f"run the same command to continue (finished trials are kept): --out {self.out}")

    def _save_state(self, state: StudyState, running: bool = True) -> None:
        if not running and state.runner_started_at is not None:
            state.active_s = state.seconds()
            state.runner_started_at = None
            state.runner_pid = None
        for record_id, live in self.live.items():
            live.files.save(self.records[record_id])
        state.saved_at = time.time()
        write_atomic(self.out / "study.json", state.model_dump_json(indent=1))

    def write_report(self) -> Path:
        return write_report(self.out, self.study)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _resolve(command: list[str]) -> list[str]:
    """The server command with its program found: on PATH, or beside this Python (a venv's bin)."""
    program = command[0]
    found = shutil.which(program) or shutil.which(program, path=str(Path(sys.executable).parent))
    if found is None:
        raise StudyError(
            f"cannot find `{program}` to start trial servers: pip install agentjet-server on this machine, "
            "or set [study] server_command to its path"
        )
    return [found, *command[1:]]
