"""The operations a researcher needs on studies and training runs, as plain functions over a
workspace: what ``agentjet-client mcp`` serves to coding agents as MCP tools and what
``agentjet-client research auto`` calls itself. One layer, so both do exactly the same thing.

Everything is read through the files the study runner writes and the servers' public and admin
APIs; nothing here trains or decides. Paths are relative to the workspace root and must stay in
it: a tool never reads or writes outside the root (a coding agent pointed at a workspace cannot
wander the machine). A *run* is named either by a server URL (``http://127.0.0.1:8000``) or by a
study trial, ``STUDY_DIR/tNNN`` (its server's port is in its ``trial.json``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx2

from agentjet_client.errors import StudyError

TIMELINE_CHARS = 4000  # of a timeline's text a tool answer holds (a model's context is not unbounded)

STUDY_DEPTH = 4  # how deep under the root studies are looked for
CHECK_TIMEOUT_S = 120.0  # a study file's check (it imports each agent)
START_WAIT_S = 60.0  # a study started is answered once its runner wrote study.json


class ToolError(Exception):
    """A tool could not do what was asked; the message says why and what to do instead."""


class _Root:
    """A workspace root and the paths in it."""

    def __init__(self, root: Path, api_key: str | None = None, timeout: float = 30.0) -> None:
        self.root = root.resolve()
        self.api_key = api_key or os.environ.get("AGENTJET_ADMIN_KEY") or os.environ.get("AGENTJET_API_KEY")
        self.timeout = timeout

    # -- paths ------------------------------------------------------------------------------------
    def path(self, relative: str, must_exist: bool = True) -> Path:
        """``relative`` under the root; ToolError when it leaves the root (or is missing)."""
        path = (self.root / relative).resolve()
        if path != self.root and self.root not in path.parents:
            raise ToolError(f"{relative} is outside the workspace {self.root}; give a path inside it")
        if must_exist and not path.exists():
            raise ToolError(f"{relative} does not exist in the workspace {self.root}")
        return path

    def study_dir(self, study: str) -> Path:
        path = self.path(study)
        if not (path / "study.json").exists():
            raise ToolError(f"{study} is not a study directory (no study.json); list_studies names them")
        return path

    def _relative(self, path: Path) -> str:
        return str(path.relative_to(self.root)) if path != self.root else "."

    def _walk(self, name: str) -> list[Path]:
        found = []
        for directory, subdirs, files in os.walk(self.root):
            depth = len(Path(directory).relative_to(self.root).parts)
            if name in files:
                found.append(Path(directory) / name)
                subdirs[:] = []  # a study's own trials are not studies
            elif depth >= STUDY_DEPTH:
                subdirs[:] = []
            subdirs[:] = [d for d in subdirs if not d.startswith(".") and d not in ("node_modules", "__pycache__")]
        return found


class _Runs(_Root):
    """The operations on runs: their servers' public and admin APIs."""

    def url(self, run: str) -> str:
        """A run's server URL: ``run`` itself, or the port of the study trial it names."""
        if run.startswith(("http://", "https://")):
            return run.rstrip("/")
        study, _, trial_id = run.rstrip("/").rpartition("/")
        if not study or not trial_id:
            raise ToolError(f"{run!r}: name a run by its server URL or as STUDY_DIR/tNNN (list_runs names them)")
        record = _trial(self.study_dir(study), trial_id)
        if not record:
            raise ToolError(f"the study {study} has no trial {trial_id}")
        if record.get("port") is None or record.get("phase") in ("pending", "done", "interrupted"):
            raise ToolError(f"{run} has no server running (phase {record.get('phase')})")
        return f"http://127.0.0.1:{record['port']}"

    def run_status(self, run: str) -> dict[str, Any]:
        """A run's server status: policy version, learner step, trajectory counts, admission."""
        return self._call(run, "GET", "/v1/status")  # type: ignore[no-any-return]

    def run_metrics(self, run: str, kind: str = "step", since: int = 0, limit: int = 200) -> dict[str, Any]:
        """A run's metrics history after line ``since``: learner steps (``step``), evaluation
        episodes (``eval``), settings changes (``config``), adopted checkpoints (``adopt``)."""
        query = f"/v1/metrics/history?since={int(since)}&kind={kind}&limit={max(1, min(int(limit), 5000))}"
        return self._call(run, "GET", query)  # type: ignore[no-any-return]

    def recent_trajectories(self, run: str, limit: int = 5) -> list[dict[str, Any]]:
        """A run's newest trajectories: task, reward (and where it came from), policy versions, and each
        timeline's text, the conversation as the model saw and wrote it (chat template included; the last
        ``TIMELINE_CHARS`` characters of a long one)."""
        body = self._call(run, "GET", f"/v1/trajectories?limit={max(1, min(int(limit), 20))}")
        out = []
        for listed in body.get("trajectories", []):
            view = self._call(run, "GET", f"/v1/trajectories/{listed['id']}")
            timelines = []
            for timeline in view.get("timelines", []):
                text = "".join(str(token[1]) for token in timeline.get("tokens", []))
                cut = len(text) > TIMELINE_CHARS
                timelines.append(
                    {"agent": timeline.get("agent"), "text": ("..." if cut else "") + text[-TIMELINE_CHARS:]}
                )
            keep = (
                "id",
                "task_id",
                "purpose",
                "status",
                "reward",
                "agent_rewards",
                "versions",
                "reward_detail",
                "error",
            )
            out.append({**{key: view.get(key) for key in keep}, "timelines": timelines})
        return out

    def set_live_setting(self, run: str, settings: dict[str, Any]) -> dict[str, Any]:
        """Change live settings of a running server (``{"lr": 0.0005}``); they apply from the next
        learner step and are written to the run's metrics.jsonl as a ``config`` line."""
        answer = self._call(run, "PATCH", "/v1/admin/config", settings)
        return {"changes": answer.get("changes", [])[-1:], "live": answer.get("live", [])}

    def pause_run(self, run: str) -> dict[str, Any]:
        """Pause learning after the step in progress (serving and ingestion go on)."""
        return self._call(run, "POST", "/v1/admin/pause")  # type: ignore[no-any-return]

    def resume_run(self, run: str) -> dict[str, Any]:
        """Start learning again after a pause."""
        return self._call(run, "POST", "/v1/admin/resume")  # type: ignore[no-any-return]

    def _call(self, run: str, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        url = self.url(run)
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            response = httpx2.request(method, url + path, json=body, headers=headers, timeout=self.timeout)
        except httpx2.HTTPError as exc:
            raise ToolError(f"the server of {run} ({url}) did not answer: {exc}") from exc
        if response.status_code >= 400:
            try:
                message = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = response.text[:500]
            raise ToolError(f"{run}: {method} {path} answered {response.status_code}: {message}")
        return response.json()


class Workspace(_Runs):
    """Every operation on the studies and runs under ``root`` (see the module's docstring)."""

    def list_studies(self) -> list[dict[str, Any]]:
        """Every study directory under the root: its name, trials done, and whether its runner runs."""
        from agentjet_client.research.trial import RunnerLock, load_state

        found = []
        for marker in sorted(self._walk("study.json")):
            out = marker.parent
            try:
                state = load_state(out)
            except (OSError, ValueError):
                continue
            done = sum(_trial(out, t).get("phase") == "done" for t in state.trials)
            found.append(
                {
                    "study": self._relative(out),
                    "name": state.name,
                    "trials": len(state.trials),
                    "done": done,
                    "runner": "finished"
                    if state.finished_at
                    else ("running" if RunnerLock(out).held_elsewhere() else "not running"),
                }
            )
        return found

    def study_status(self, study: str) -> dict[str, Any]:
        """A study's progress: each trial's phase, episodes, last reward, metric, settings now, events."""
        from agentjet_client.research.trial import RunnerLock, load_state

        out = self.study_dir(study)
        state = load_state(out)
        trials = []
        for trial_id in state.trials:
            record = _trial(out, trial_id)
            trials.append(
                {
                    "trial": trial_id,
                    "run": f"{self._relative(out)}/{trial_id}",
                    "phase": record.get("phase"),
                    "status": record.get("status"),
                    "episodes": record.get("episodes", 0),
                    "target_episodes": record.get("target_episodes", 0),
                    "last_reward": record.get("last_reward"),
                    "metric": record.get("metric"),
                    "settings": {**record.get("settings", {}), **record.get("changed", {})},
                    "reason": record.get("reason"),
                    "events": record.get("events", [])[-5:],
                }
            )
        running = RunnerLock(out).held_elsewhere()
        return {
            "study": self._relative(out),
            "name": state.name,
            "runner": "finished" if state.finished_at else ("running" if running else "not running"),
            "minutes": round(state.seconds() / 60, 2),
            "trials": trials,
            "report": self._relative(out / "report.md") if (out / "report.md").exists() else None,
        }

    def check_study(self, study_file: str) -> dict[str, Any]:
        """Validate a study file and its agents' code dirs without running it: what it plans (trials,
        search, metric, trials at once, code dirs). Checked in an interpreter of its own (``research
        check``): loading an agent runs its code, and that never happens in this process."""
        path = self.path(study_file)
        command = [sys.executable, "-m", "agentjet_client", "research", "check", "--json", str(path)]
        try:
            done = subprocess.run(
                command,
                capture_output=True,
                text=True,
                timeout=CHECK_TIMEOUT_S,
                cwd=str(path.parent),
                env={**os.environ, "COLUMNS": "400"},
            )
        except subprocess.TimeoutExpired:
            raise ToolError(
                f"checking {study_file} took over {CHECK_TIMEOUT_S:.0f}s (an agent that hangs on import?)"
            ) from None
        if done.returncode != 0:
            message = " ".join((done.stderr or done.stdout).split()).removeprefix("error: ")
            raise ToolError(message or f"checking {study_file} failed (exit {done.returncode})")
        plan: dict[str, Any] = json.loads(done.stdout)
        return {"study_file": self._relative(path), **plan}

    def start_study(self, study_file: str, out: str) -> dict[str, Any]:
        """Start ``agentjet-client research run STUDY_FILE --out OUT`` in the background (its own
        session: it outlives this process). The same call on an ``out`` that holds a stopped study
        continues it."""
        from agentjet_client.research.trial import Process, RunnerLock

        self.check_study(study_file)
        target = self.path(out, must_exist=False)
        if RunnerLock(target).held_elsewhere():
            raise ToolError(f"a runner already runs the study in {out}; study_status follows it, stop_study stops it")
        target.mkdir(parents=True, exist_ok=True)
        log = target / "runner.log"
        command = [sys.executable, "-m", "agentjet_client", "research", "run", str(self.path(study_file))]
        command += ["--out", str(target)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        process = Process.spawn(command, log, env, str(target), cwd=str(self.root)).popen
        assert process is not None
        deadline = time.monotonic() + START_WAIT_S  # until the runner holds the study (or has failed)
        lock = RunnerLock(target)
        while process.poll() is None and time.monotonic() < deadline:
            if (target / "study.json").exists() and lock.held_elsewhere():
                break
            time.sleep(0.1)
        if process.poll() not in (None, 0):
            from agentjet_client.research.trial import last_lines

            raise ToolError(f"the study's runner exited ({process.returncode}): {last_lines(log, 4)}")
        return {"study": self._relative(target), "pid": process.pid, "log": self._relative(log)}

    def stop_study(self, study: str) -> dict[str, Any]:
        """Ask a study's runner to stop (as Ctrl-C does): every running trial checkpoints first;
        start_study with the same out continues it."""
        from agentjet_client.research.trial import RunnerLock, load_state

        out = self.study_dir(study)
        pid = load_state(out).runner_pid
        if pid is None or not RunnerLock(out).held_elsewhere():
            raise ToolError(f"no runner runs the study in {study}")
        try:
            os.kill(pid, signal.SIGINT)
        except ProcessLookupError:
            raise ToolError(f"the runner of {study} (pid {pid}) is gone") from None
        return {"study": study, "message": f"runner pid {pid} asked to stop; trials checkpoint before they end"}

    def read_report(self, study: str) -> str:
        """A study's report (markdown), written again from its files first."""
        from agentjet_client.research.report import write_report
        from agentjet_client.research.study import study_of

        out = self.study_dir(study)
        try:
            return write_report(out, study_of(out)).read_text()
        except (StudyError, OSError, ValueError) as exc:
            raise ToolError(f"cannot write the report of {study}: {exc}") from exc

    def read_file(self, path: str, limit: int = 20000) -> str:
        """A text file of the workspace (a log, a code dir's agent.py, a study file): its last ``limit`` characters."""
        target = self.path(path)
        if not target.is_file():
            raise ToolError(f"{path} is not a file")
        return target.read_text(errors="replace")[-limit:]

    def list_runs(self) -> list[dict[str, Any]]:
        """Every study trial under the root, with its server URL and phase."""
        runs = []
        for study in self.list_studies():
            out = self.path(study["study"])
            for marker in sorted((out / "trials").glob("t*/trial.json")):
                record = _trial(out, marker.parent.name)
                port = record.get("port")
                runs.append(
                    {
                        "run": f"{study['study']}/{marker.parent.name}",
                        "url": f"http://127.0.0.1:{port}" if port else None,
                        "phase": record.get("phase"),
                        "episodes": record.get("episodes", 0),
                    }
                )
        return runs


def _trial(out: Path, trial_id: str) -> dict[str, Any]:
    try:
        return json.loads((out / "trials" / trial_id / "trial.json").read_text())  # type: ignore[no-any-return]
    except (OSError, ValueError):
        return {}
