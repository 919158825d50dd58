"""Sync agents in worker processes, so an episode stuck in a blocking call can be abandoned for real.

A thread cannot be stopped from outside: a sync agent stuck in ``time.sleep(10**6)`` or a socket
read would hold its thread forever, and every such hang would cost the runner one unit of
concurrency. So, when the agent comes from a code directory, the runner hands sync episodes to a
``WorkerPool``: at most ``size`` spawned processes, each importing the agent from the directory.
The agent's ``episode`` there is a ``ProxyEpisode`` whose model handles go through the client's
loopback capture proxy, so every call is still recorded into the episode's trajectory. An episode
past its timeout has its worker killed and replaced by a spare that was started ahead of time:
the pool never holds more than ``size + spares`` processes and never loses capacity.

Each worker runs the code that is on disk when it takes the episode, and reports the code version
it ran; after an edit (hot swap) workers re-import before their next episode. A worker's start-up
(spawn + import) is not counted against an episode's timeout. A new worker cannot start while the
code on disk does not import: its episodes fail with the import error until the edit is fixed.

A pool given ``python=`` (a code dir with its own interpreter, see ``tracks``) starts its workers
with that interpreter instead (a plain subprocess speaking over a socket pair; that interpreter needs
agentjet-client installed, nothing of this process's environment is imported there). Such workers
run async agents too (``asyncio.run``), since this process cannot import their code.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import numbers
import os
import signal
import socket
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from agentjet_client.capture.episode import LLM_RETRIES
from agentjet_client.errors import AgentJetError
from agentjet_client.failures import describe
from agentjet_client.protocol import check_agent_name

STARTUP_TIMEOUT = 120.0  # seconds a new worker may take to import the agent


class AgentFailed(AgentJetError):
    """The agent raised in its worker process: the message names the exception and the agent's line;
    ``trace`` is the traceback of the agent's own frames (``failures.describe``)."""

    def __init__(self, message: str, trace: str | None = None) -> None:
        super().__init__(message)
        self.trace = trace or message


# agent SDKs the fork server may import ahead of the workers (none starts a thread at import), by the
# top-level name an agent imports; and what each of the episode's SDK helpers imports when it is called
PRELOADABLE = frozenset(
    "anthropic langchain langchain_core langchain_openai agentscope agents pydantic_ai smolagents".split()
)
HELPER_IMPORTS = {
    "anthropic": ("agentjet_client.capture.adapters.anthropic", "anthropic"),
    "async_anthropic": ("agentjet_client.capture.adapters.anthropic", "anthropic"),
    "langchain": ("agentjet_client.capture.adapters.langchain", "langchain_openai"),
    "agentscope": ("agentjet_client.capture.adapters.agentscope", "agentscope.model", "agentscope.credential"),
}
MAX_SCANNED = 200  # files of a code dir read for its imports (a vendored tree is not worth the start-up)
_PRELOAD: list[str] = ["agentjet_client.run.isolation", "openai", "httpx2"]


def sdk_imports(code_dir: Path) -> list[str]:
    """The agent SDK modules the code in ``code_dir`` imports or has the episode import for it
    (``episode.anthropic()`` ...), in a stable order. Each worker would import them again itself
    (an SDK costs about 1 s of CPU: 16 workers, 16 s); the fork server imports them once and every
    worker forked from it has them. A module named like one of the code dir's own is left out."""
    import ast

    if not code_dir.is_dir():
        return []
    local = {path.stem for path in code_dir.glob("*.py")} | {path.name for path in code_dir.iterdir() if path.is_dir()}
    found: set[str] = set()
    files = [path for path in sorted(code_dir.rglob("*.py")) if "__pycache__" not in path.parts][:MAX_SCANNED]
    for path in files:
        try:
            tree = ast.parse(path.read_bytes(), filename=str(path))
        except (SyntaxError, ValueError, OSError):
            continue  # the worker's own import says what is wrong with it
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.add(node.module)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                found.update(HELPER_IMPORTS.get(node.func.attr, ()))
    wanted = (name for name in found if name.partition(".")[0] in PRELOADABLE or name.startswith("agentjet_client."))
    return sorted(name for name in wanted if name.partition(".")[0] not in local)


def _context(code_dir: Path | None = None) -> Any:
    """Workers fork from a server process that has already imported the client, the OpenAI SDK and the
    agent SDKs the code dir uses (``forkserver``): a new worker costs a fork, not a fresh interpreter
    (about 1 s of CPU each) and its SDK's imports. Where there is no fork (Windows), they are spawned.
    The fork server starts with the first worker: a later pool's SDKs are imported by its workers."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    if code_dir is not None:
        _PRELOAD.extend(name for name in sdk_imports(code_dir) if name not in _PRELOAD)
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(_PRELOAD))
    return context


@dataclass
class _Worker:
    process: Any  # a multiprocessing.Process or a _Child: kill(), join(timeout), is_alive()
    conn: Any


class _Child:
    """A worker started with another interpreter, with the part of ``Process``'s surface the pool uses."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self.popen = popen

    def kill(self) -> None:
        self.popen.kill()

    def join(self, timeout: float | None = None) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def is_alive(self) -> bool:
        return self.popen.poll() is None


# what a worker in another interpreter runs: serve episodes over the inherited socket
_FOREIGN_MAIN = (
    "import sys; from agentjet_client.run.isolation import serve_fd; serve_fd(int(sys.argv[1]), sys.argv[2])"
)


class ProxyEpisode:
    """What a sync agent in a worker process gets as ``episode`` (an ``EpisodeHandle``): model
    handles through the capture proxy, which sends each agent's calls to that agent's server."""

    def __init__(self, episode_id: str, task_id: str, proxy_base: str, api_key: str) -> None:
        self.id = episode_id
        self.task_id = task_id
        self.api_key = api_key
        self._proxy_base = proxy_base

    def url_for(self, agent: str) -> str:
        return f"{self._proxy_base}/episodes/{self.id}/{check_agent_name(agent)}/v1"

    @property
    def base_url(self) -> str:
        return self.url_for("default")

    def _base(self, agent: str, train: bool) -> str:
        return self.url_for(agent) if train else f"{self._proxy_base}/untrained/{check_agent_name(agent)}/v1"

    def openai(self, agent: str = "default", *, train: bool = True, **kwargs: Any) -> Any:
        import openai

        kwargs.setdefault("max_retries", LLM_RETRIES)
        kwargs.setdefault("http_client", _shared_http())  # a new client per episode costs ~40 ms (SSL setup)
        return openai.OpenAI(base_url=self._base(agent, train), api_key=self.api_key, **kwargs)

    def langchain(self, agent: str = "default", **kwargs: Any) -> Any:
        from agentjet_client.capture.adapters.langchain import chat_model

        kwargs.setdefault("http_client", _shared_http())  # not one cached pool per episode URL
        return chat_model(self.url_for(agent), self.api_key, LLM_RETRIES, **kwargs)

    def agentscope(self, agent: str = "default", **kwargs: Any) -> Any:
        from agentjet_client.capture.adapters.agentscope import chat_model

        return chat_model(self.url_for(agent), self.api_key, LLM_RETRIES, **kwargs)

    def async_openai(self, agent: str = "default", *, train: bool = True, **kwargs: Any) -> Any:
        import openai

        kwargs.setdefault("max_retries", LLM_RETRIES)
        return openai.AsyncOpenAI(base_url=self._base(agent, train), api_key=self.api_key, **kwargs)

    def anthropic(self, agent: str = "default", **kwargs: Any) -> Any:
        from agentjet_client.capture.adapters.anthropic import client

        kwargs.setdefault("http_client", _shared_http())
        return client(self.url_for(agent), self.api_key, LLM_RETRIES, asynchronous=False, **kwargs)

    def async_anthropic(self, agent: str = "default", **kwargs: Any) -> Any:
        from agentjet_client.capture.adapters.anthropic import client

        return client(self.url_for(agent), self.api_key, LLM_RETRIES, asynchronous=True, **kwargs)

    def reward_turn(self, reward: float, agent: str | None = None) -> None:
        """``Episode.reward_turn``, told to the runner's capture proxy (which holds the turns)."""
        answer = _shared_http().post(
            f"{self._proxy_base}/episodes/{self.id}/turn_reward", json={"reward": reward, "agent": agent}
        )
        if answer.status_code != 200:
            raise ValueError(answer.json().get("error", {}).get("message", answer.text))


_HTTP: Any = None


def _shared_http() -> Any:
    """One connection pool per worker process for the sync OpenAI clients its episodes create."""
    global _HTTP
    if _HTTP is None:
        import httpx2

        _HTTP = httpx2.Client(timeout=httpx2.Timeout(600.0, connect=10.0))
    return _HTTP


class WorkerPool:
    """At most ``size`` episodes at once, each in a worker process; ``spares`` more processes are
    kept started and idle, so the worker that replaces a killed one is ready before it is needed
    (spawn + import takes a second or two; it is never on an episode's critical path once the
    pool is warm). Processes alive never exceed ``size + spares``."""

    def __init__(self, code_dir: Path, size: int, spares: int = 1, python: str | None = None) -> None:
        self.code_dir = Path(code_dir).resolve()
        self.python = python  # another interpreter for the workers (None: this one, forked)
        self.size = size
        self.spares = spares
        self.started = 0  # processes ever started (replacements included)
        self.killed = 0  # workers killed because their episode timed out (or was cancelled)
        self.peak = 0  # most processes alive at once
        self._context = _context(self.code_dir if python is None else None)
        self._idle: asyncio.Queue[_Worker | BaseException] | None = None
        self._live = 0
        self._pending = 0  # workers started in the background, not yet ready
        self._waiting = 0  # episodes waiting for one of them
        self._background: set[asyncio.Task[None]] = set()
        self._free: asyncio.Semaphore | None = None
        self._waits = ThreadPoolExecutor(max_workers=size + spares, thread_name_prefix="agentjet-worker-wait")

    @property
    def live(self) -> int:
        """Worker processes that exist now (never more than ``size + spares``)."""
        return self._live

    def _start(self) -> _Worker:
        if self.python is not None:
            return self._start_foreign(self.python)
        parent, child = self._context.Pipe()
        process = self._context.Process(
            target=_worker_main, args=(child, str(self.code_dir), dict(os.environ)), name="agentjet-agent", daemon=True
        )
        process.start()
        child.close()
        self.started += 1
        self._live += 1
        self.peak = max(self.peak, self._live)
        return _Worker(process, parent)

    def _start_foreign(self, python: str) -> _Worker:
        ours, theirs = socket.socketpair()
        try:
            popen = subprocess.Popen(
                [python, "-c", _FOREIGN_MAIN, str(theirs.fileno()), str(self.code_dir)],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
            )
        except OSError as exc:
            ours.close()
            raise AgentFailed(f"cannot start {python} for the agent in {self.code_dir}: {exc}") from exc
        finally:
            theirs.close()
        self.started += 1
        self._live += 1
        self.peak = max(self.peak, self._live)
        return _Worker(_Child(popen), Connection(ours.detach()))

    async def _ready(self, worker: _Worker) -> _Worker:
        """``worker`` once it has imported the agent (start-up is not part of any episode's timeout)."""
        loop = asyncio.get_running_loop()
        try:
            if not await loop.run_in_executor(self._waits, worker.conn.poll, STARTUP_TIMEOUT):
                raise AgentFailed(f"an agent worker process did not start within {STARTUP_TIMEOUT:g}s")
            kind, detail = worker.conn.recv()
        except EOFError:
            self._kill(worker)
            raise AgentFailed(
                f"the agent worker for {self.code_dir} exited while starting (its output above says why)"
            ) from None
        except BaseException:
            self._kill(worker)
            raise
        if kind != "ready":
            self._kill(worker)
            raise AgentFailed(f"the agent worker could not load the code in {self.code_dir}: {detail}")
        return worker

    def _top_up(self) -> None:
        """Start spares in the background until ``spares`` are idle or on their way."""
        assert self._idle is not None
        while self._idle.qsize() + self._pending < self.spares and self._live < self.size + self.spares:
            worker = self._start()
            self._pending += 1
            task = asyncio.ensure_future(self._background_ready(worker))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _background_ready(self, worker: _Worker) -> None:
        assert self._idle is not None
        try:
            item: _Worker | BaseException = await self._ready(worker)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # handed to whoever takes it: that episode fails with the reason
            item = exc
        finally:
            self._pending -= 1
        self._idle.put_nowait(item)

    async def _take(self) -> _Worker:
        assert self._idle is not None
        if self._idle.empty() and self._pending <= self._waiting:
            return await self._ready(self._start())  # nothing on its way: start one for this episode
        self._waiting += 1
        try:
            item = await self._idle.get()
        finally:
            self._waiting -= 1
        if isinstance(item, BaseException):
            raise item
        return item

    def _kill(self, worker: _Worker) -> None:
        worker.process.kill()
        worker.process.join(timeout=10)
        worker.conn.close()
        self._live -= 1

    async def run(
        self, task: Any, episode_id: str, task_id: str, proxy_base: str, api_key: str, timeout: float
    ) -> tuple[Any, str]:
        """The agent's return value and the code version that ran; TimeoutError past ``timeout``."""
        if self._free is None or self._idle is None:
            self._free = asyncio.Semaphore(self.size)
            self._idle = asyncio.Queue()
        async with self._free:
            worker = await self._take()
            self._top_up()
            loop = asyncio.get_running_loop()
            try:
                worker.conn.send((task, episode_id, task_id, proxy_base, api_key))
                answered = await loop.run_in_executor(self._waits, worker.conn.poll, timeout)
                if not answered:
                    raise TimeoutError
                kind, value, version = worker.conn.recv()
            except BaseException:  # timed out, cancelled, or the worker died: it is not reused
                self._kill(worker)
                self.killed += 1
                self._top_up()
                raise
            self._idle.put_nowait(worker)
        if kind == "error":
            raise AgentFailed(*value)
        return value, version

    def close(self) -> None:
        for task in self._background:
            task.cancel()
        idle: list[_Worker] = []
        while self._idle is not None and not self._idle.empty():
            item = self._idle.get_nowait()
            if isinstance(item, _Worker):
                idle.append(item)
        for worker in idle:
            try:
                worker.conn.send(None)
            except OSError:
                pass
        for worker in idle:
            worker.process.join(timeout=5)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join(timeout=5)
            worker.conn.close()
            self._live -= 1
        self._waits.shutdown(wait=False, cancel_futures=True)


def _plain(value: Any) -> Any:
    """A reward as built-in numbers (a numpy float from the agent's interpreter may not unpickle here)."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool | int | float):
        return float(value)
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return value


def serve_fd(fd: int, code_dir: str) -> None:
    """A worker in another interpreter (``WorkerPool(python=...)``): serve over socket ``fd``."""
    _worker_main(Connection(fd), code_dir, dict(os.environ))


def _worker_main(conn: Any, code_dir: str, environ: dict[str, str]) -> None:
    from agentjet_client.run.loader import CodeWatcher, code_version, load_agent

    os.environ.clear()  # the runner's environment now, not the fork server's from when it started
    os.environ.update(environ)

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the runner decides when workers stop
    directory = Path(code_dir)
    try:
        agent, version = load_agent(directory)
    except Exception as exc:  # e.g. a broken edit on disk: the episode fails with this message
        conn.send(("failed", str(exc)))
        return
    import openai  # noqa: F401  (imported now, not in the first episode's time: ~1 s on a busy machine)

    _shared_http()
    conn.send(("ready", version))
    watcher = CodeWatcher(directory, version)
    while True:
        job = conn.recv()
        if job is None:
            return
        if code_version(directory) != version:  # hot swap: take the edit if it loads
            swapped = watcher.poll()
            if swapped is not None:
                agent, version = swapped
        task, episode_id, task_id, proxy_base, api_key = job
        try:
            episode = ProxyEpisode(episode_id, task_id, proxy_base, api_key)
            value = agent.fn(task, episode)
            if agent.is_async:  # only a worker in another interpreter is given async agents
                value = asyncio.run(value)
            rubric = agent.rubric
            if rubric is not None:  # the reward functions run where the agent did
                value = rubric.score_sync(task, value, episode)
            conn.send(("ok", _plain(value), version))
        except Exception as exc:  # the agent's bug: reported, the worker lives on
            failure = describe(exc)
            conn.send(("error", (failure.line, failure.trace), version))
