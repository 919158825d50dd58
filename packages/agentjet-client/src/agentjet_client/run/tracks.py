"""Tracks: the code dirs of one run, each with its agent, its tag, its code version, its workers and,
optionally, its own Python interpreter.

``agentjet-client run --code-dir A --code-dir B`` runs two task families in one run (a cocktail);
the server's ``--mix`` decides how many episodes of each tag start (``admission``). A code dir can
name its own interpreter in an ``agentjet.toml`` beside its agent::

    # examples/tools/agentjet.toml
    python = "../../.venvs/tools/bin/python"   # a path (relative to this file) or a command on PATH

Its agent then never runs in this process: every episode (sync or async) runs in a worker started
with that interpreter (``isolation.WorkerPool(python=...)``), which needs agentjet-client installed
and nothing else of this environment. This process still needs to know the agent's name, tag and
tasks: it asks that interpreter (``describe``: a short-lived process that imports the code dir and
writes them to a file), once at start, after each edit (hot swap: an edit that does not import
there is reported and the previous code keeps running), and, if the task source is a callable
(which may make new tasks each time), once per pass over the tasks; a list is read once per code
version. Tasks cross between the interpreters pickled: they must be plain data (dicts of strings,
numbers, lists), which tasks are anyway in practice.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from agentjet_client.capture.episode import Episode
from agentjet_client.errors import AgentLoadError
from agentjet_client.run.isolation import STARTUP_TIMEOUT, AgentFailed, WorkerPool
from agentjet_client.run.loader import CodeWatcher, Watcher, load_agent
from agentjet_client.run.report import RunReport
from agentjet_client.tasks.agent import SwarmAgent, Task
from agentjet_client.tasks.judges import Judge
from agentjet_client.tasks.sources import TaskSpec
from agentjet_client.version import __version__

RUNTIME_FILE = "agentjet.toml"
RUNTIME_KEYS = {"python"}

# what ``describe`` runs in the other interpreter: argv = code dir, out file, what to load
_DESCRIBE = """
import pickle, sys
from pathlib import Path
out = Path(sys.argv[2])
try:
    import agentjet_client
    from agentjet_client.run.loader import load_agent
except ImportError as exc:
    out.write_bytes(pickle.dumps(("missing", str(exc))))
    raise SystemExit(0)
try:
    agent, version = load_agent(Path(sys.argv[1]))
except Exception as exc:
    out.write_bytes(pickle.dumps(("error", str(exc))))
    raise SystemExit(0)
try:
    what = sys.argv[3]
    tasks = agent.load_tasks(evaluation=what == "eval") if what != "none" else None
except Exception as exc:
    out.write_bytes(pickle.dumps(("invalid", str(exc))))
    raise SystemExit(0)
if agent.judge is not None:
    out.write_bytes(pickle.dumps(("error", "its reward is an LLM judge, which runs in the runner's own interpreter: "
                                  "run this code dir without a python in agentjet.toml, or score it with a Rubric")))
    raise SystemExit(0)
info = dict(name=agent.name, tag=agent.tag, is_async=agent.is_async, has_eval_tasks=agent.eval_tasks is not None,
            version=version, client_version=agentjet_client.__version__, tasks=tasks,
            fixed=agent.task_spec.fixed(what == "eval"))
try:
    out.write_bytes(pickle.dumps(("ok", info)))
except Exception as exc:
    out.write_bytes(pickle.dumps(("unreadable", str(exc))))
"""


def runtime_python(code_dir: Path) -> str | None:
    """The interpreter ``DIR/agentjet.toml`` names (an absolute path), or None to use this one."""
    path = code_dir / RUNTIME_FILE
    if not path.exists():
        return None
    try:
        config = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise AgentLoadError(f"cannot read {path}: {exc}") from exc
    unknown = sorted(set(config) - RUNTIME_KEYS)
    if unknown:
        raise AgentLoadError(f"{path}: unknown keys {unknown}; the keys it may hold are {sorted(RUNTIME_KEYS)}")
    python = config.get("python")
    if python is None:
        return None
    if not isinstance(python, str) or not python:
        raise AgentLoadError(f'{path}: python must be a path or command, e.g. python = "/opt/venv/bin/python"')
    candidate = (code_dir / python) if ("/" in python or os.sep in python) else None
    resolved = str(candidate) if candidate is not None and candidate.exists() else shutil.which(python)
    if resolved is None:
        raise AgentLoadError(
            f"{path} names python = {python!r}, which does not exist; give the path (absolute or relative to "
            "that file) of an interpreter with agentjet-client installed"
        )
    resolved = os.path.abspath(resolved)  # not resolve(): a venv's python is a symlink to the base one
    return None if resolved == os.path.abspath(sys.executable) else resolved


@dataclass
class Described:
    name: str
    tag: str | None
    is_async: bool
    has_eval_tasks: bool
    version: str
    client_version: str
    tasks: list[tuple[str, Task]] | None
    fixed: bool  # the task source is a list (not a callable that may make new tasks each time)


def describe(python: str, code_dir: Path, what: str = "train") -> Described:
    """Import ``code_dir`` with ``python`` and return its agent's particulars (and its training
    tasks, eval tasks or none: ``what`` = train | eval | none). Raises AgentLoadError (it does not
    import there) or ValueError (its tasks are unusable, as ``SwarmAgent.load_tasks`` says)."""
    with tempfile.TemporaryDirectory(prefix="agentjet-describe-") as tmp:
        out = Path(tmp) / "out.pickle"
        try:
            done = subprocess.run(
                [python, "-c", _DESCRIBE, str(code_dir), str(out), what],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=STARTUP_TIMEOUT,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise AgentLoadError(f"cannot run {python} to load {code_dir}: {exc}") from exc
        if not out.exists():
            tail = " ".join(done.stderr.strip().splitlines()[-3:])
            raise AgentLoadError(f"{python} exited with code {done.returncode} loading {code_dir}: {tail}")
        try:
            kind, value = pickle.loads(out.read_bytes())
        except Exception as exc:  # e.g. a task holding an object of a package only that interpreter has
            kind, value = "unreadable", str(exc)
    if kind == "unreadable":
        raise AgentLoadError(
            f"the tasks of {code_dir} (loaded by {python}) cannot be passed to this process ({value}); tasks of an "
            "agent in its own interpreter must be plain data: dicts of strings, numbers and lists"
        )
    if kind == "missing":
        raise AgentLoadError(
            f"{python} (named in {code_dir / RUNTIME_FILE}) cannot import agentjet_client ({value}); "
            f"install it there: {python} -m pip install agentjet-client"
        )
    if kind == "invalid":  # the agent's tasks: as SwarmAgent.load_tasks says in this process
        raise ValueError(value)
    if kind == "error":
        raise AgentLoadError(f"{value} (in {python})")
    return Described(**value)


@dataclass
class RemoteAgent:
    """The agent of a code dir with its own interpreter, as this process knows it: its particulars,
    and its tasks on demand. Its episodes run only in that interpreter's workers."""

    python: str
    code_dir: Path
    name: str
    tag: str | None
    is_async: bool
    has_eval_tasks: bool
    _fixed: dict[bool, list[tuple[str, Task]]] = field(default_factory=dict)  # task lists, by evaluation

    @property
    def eval_tasks(self) -> bool | None:
        return True if self.has_eval_tasks else None

    def load_tasks(self, evaluation: bool = False) -> list[tuple[str, Task]]:
        if evaluation and not self.has_eval_tasks:
            raise ValueError(
                f"agent '{self.name}' has no evaluation tasks; give @swarm_agent(eval_tasks=...) held-out tasks"
            )
        if evaluation in self._fixed:
            return list(self._fixed[evaluation])
        info = describe(self.python, self.code_dir, "eval" if evaluation else "train")
        assert info.tasks is not None
        if info.fixed:
            self._fixed[evaluation] = info.tasks
        return list(info.tasks)

    @classmethod
    def load(cls, python: str, code_dir: Path) -> tuple[RemoteAgent, str]:
        info = describe(python, code_dir, "none")
        if info.client_version != __version__:
            raise AgentLoadError(
                f"{python} has agentjet-client {info.client_version}, this run {__version__}; install the same "
                f"version there: {python} -m pip install agentjet-client=={__version__}"
            )
        agent = cls(python, code_dir, info.name, info.tag, info.is_async, info.has_eval_tasks)
        return agent, info.version


class RemoteWatcher(Watcher[RemoteAgent]):
    """The ``Watcher`` of a code dir with its own interpreter: an edit is taken once it imports there
    (the workers re-import it themselves before their next episode)."""

    def __init__(self, python: str, code_dir: Path, version: str) -> None:
        super().__init__(code_dir, version)
        self.python = python

    def load(self) -> tuple[RemoteAgent, str]:
        return RemoteAgent.load(self.python, self.code_dir)


@dataclass
class Track:
    """One code dir of a run (or an agent given in code): what starts its episodes and runs them."""

    agent: SwarmAgent | RemoteAgent
    code_version: str | None = None
    watcher: CodeWatcher | RemoteWatcher | None = None
    workers: WorkerPool | None = None  # sync agents (and every agent of another interpreter) run here
    code_dir: Path | None = None
    episodes: int = field(default=0)  # training episodes started from this track
    # the run's own task source (``run --tasks/--split/--eval-tasks``): TaskSpec fields that replace the agent's
    task_options: dict[str, Any] = field(default_factory=dict)

    @property
    def tag(self) -> str | None:
        return self.agent.tag

    def _spec(self) -> TaskSpec:
        options = self.task_options
        if isinstance(self.agent, SwarmAgent):
            return replace(self.agent.task_spec, **options)
        if "tasks" not in options:  # a code dir in its own interpreter: its tasks are read there
            raise ValueError(
                f"the agent in {self.code_dir} runs in its own interpreter: give --tasks with --split or --eval-tasks"
            )
        return TaskSpec(**options, owner=f"--tasks {options['tasks']}")

    @property
    def judge(self) -> Judge | None:
        """The agent's LLM judge (an agent in its own interpreter has none: ``describe`` refuses it)."""
        return self.agent.judge if isinstance(self.agent, SwarmAgent) else None

    @property
    def has_eval_tasks(self) -> bool:
        if "eval_tasks" in self.task_options:
            return self.task_options["eval_tasks"] is not None
        if self.task_options and not isinstance(self.agent, SwarmAgent):
            return False
        return self.agent.eval_tasks is not None

    def load_tasks(self, evaluation: bool = False) -> list[tuple[str, Task]]:
        """``(task id, task)`` pairs of this code dir's training (or evaluation) tasks: the agent's, or the
        run's own source where it gives one."""
        if not self.task_options:
            return self.agent.load_tasks(evaluation)
        return self._spec().load(evaluation)

    @property
    def remote(self) -> bool:
        return isinstance(self.agent, RemoteAgent)

    def in_workers(self, agent: Any) -> bool:
        """Whether ``agent``'s episodes go to the worker pool (else they run in this process)."""
        return self.workers is not None and (isinstance(agent, RemoteAgent) or not agent.is_async)

    async def play(
        self, agent: SwarmAgent | RemoteAgent, task: Task, episode: Episode, timeout: float, executor: Executor
    ) -> tuple[Any, str | None]:
        """Run one episode of ``agent`` (this track's, as it was when the episode started) within
        ``timeout``: in a worker, as a coroutine here, or in ``executor``'s threads. Returns what the
        agent returned, and the code version a worker ran (None: the one the episode started with)."""
        if self.in_workers(agent):
            assert self.workers is not None
            proxy_base = episode.base_url.split("/episodes/", 1)[0]
            return await self.workers.run(task, episode.id, episode.task_id, proxy_base, episode.api_key, timeout)
        if isinstance(agent, RemoteAgent):
            raise AgentFailed(f"the agent in {self.code_dir} runs in its own interpreter and needs workers")
        if agent.is_async:
            value = await asyncio.wait_for(agent.fn(task, episode), timeout)
        else:
            loop = asyncio.get_running_loop()
            value = await asyncio.wait_for(loop.run_in_executor(executor, agent.fn, task, episode), timeout)
        rubric = agent.rubric  # reward functions score the result here (a worker scores its own)
        return (await rubric.score(task, value, episode) if rubric is not None else value), None

    async def watch(self, interval: float, report: RunReport, on_reload: Callable[[str, str | None], None]) -> None:
        """Hot swap: new episodes take the new code; running ones finish on the code they started with."""
        watcher = self.watcher
        assert watcher is not None
        while True:
            await asyncio.sleep(interval)
            swapped = await asyncio.to_thread(watcher.poll)
            if swapped is not None:
                self.agent, self.code_version = swapped
                report.reloads.append(swapped[1])
                on_reload(swapped[1], None)
            elif watcher.last_error and (not report.reload_errors or report.reload_errors[-1] != watcher.last_error):
                report.reload_errors.append(watcher.last_error)
                on_reload(watcher.version, watcher.last_error)


def open_track(code_dir: Path, *, concurrency: int, isolate: bool = True, watch: bool = True) -> Track:
    """The track of ``code_dir``: its agent loaded here, or, with an interpreter of its own
    (``agentjet.toml``), described by that interpreter and run only there."""
    code_dir = Path(code_dir).resolve()
    if not code_dir.is_dir():
        raise AgentLoadError(f"--code-dir {code_dir} is not a directory")
    python = runtime_python(code_dir)
    if python is not None:
        remote, version = RemoteAgent.load(python, code_dir)
        return Track(
            remote,
            version,
            RemoteWatcher(python, code_dir, version) if watch else None,
            WorkerPool(code_dir, concurrency, python=python),
            code_dir,
        )
    agent, version = load_agent(code_dir)
    return Track(
        agent,
        version,
        CodeWatcher(code_dir, version) if watch else None,
        WorkerPool(code_dir, concurrency) if isolate and not agent.is_async else None,
        code_dir,
    )
