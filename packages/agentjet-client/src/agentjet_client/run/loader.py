"""Load the ``@swarm_agent`` from a code directory, fingerprint that code, and watch it for edits.

``DIR/agent.py`` is imported if it exists, else the single ``*.py`` file in DIR that defines a
``SwarmAgent``. DIR goes on ``sys.path`` so the agent can import its sibling modules. The code
version is a hash of every ``*.py`` file under DIR, so a trajectory says which code made it.

``CodeWatcher`` re-imports the directory when its code version changes (hot swap): sibling modules
from DIR are dropped from ``sys.modules`` first so that edits to them count too; an edit that does
not import is reported once and the previous agent stays in use. ``Watcher`` is the polling it
shares with ``tracks.RemoteWatcher`` (a code dir run by another interpreter).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import sys
import traceback
from pathlib import Path
from types import ModuleType
from typing import Generic, TypeVar

from agentjet_client.errors import AgentLoadError
from agentjet_client.tasks.agent import SwarmAgent

logger = logging.getLogger(__name__)

AgentT = TypeVar("AgentT")  # what a watcher loads: a ``SwarmAgent``, or a ``tracks.RemoteAgent``


def code_version(code_dir: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(code_dir.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        digest.update(str(path.relative_to(code_dir)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def _import(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise AgentLoadError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        detail = "".join(traceback.format_exception_only(exc)).strip()
        raise AgentLoadError(f"importing {path} failed: {detail}") from exc
    return module


def _agents_in(module: ModuleType) -> list[SwarmAgent]:
    return [value for value in vars(module).values() if isinstance(value, SwarmAgent)]


def load_agent(code_dir: Path) -> tuple[SwarmAgent, str]:
    """The directory's agent and its code version."""
    code_dir = code_dir.resolve()
    if not code_dir.is_dir():
        raise AgentLoadError(f"--code-dir {code_dir} is not a directory")
    if str(code_dir) not in sys.path:
        sys.path.insert(0, str(code_dir))
    version = code_version(code_dir)
    candidates = [code_dir / "agent.py"] if (code_dir / "agent.py").exists() else sorted(code_dir.glob("*.py"))
    found: list[SwarmAgent] = []
    for path in candidates:
        found.extend(_agents_in(_import(path, f"agentjet_user_{path.stem}_{version}")))
    if not found:
        raise AgentLoadError(
            f"no @swarm_agent found in {code_dir}; decorate your episode function with "
            "@swarm_agent(tasks=...) in agent.py"
        )
    if len(found) > 1:
        names = ", ".join(a.name for a in found)
        raise AgentLoadError(f"{code_dir} defines several agents ({names}); keep exactly one @swarm_agent")
    return found[0], version


def _forget_modules_under(code_dir: Path) -> None:
    """Drop DIR's sibling modules from the import cache, so the next import reads the edited files."""
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if path and not name.startswith("agentjet_user_") and Path(path).resolve().is_relative_to(code_dir):
            del sys.modules[name]


class Watcher(Generic[AgentT]):
    """Polled by the runner: returns the new agent after an edit that loads (``load``), else None. An
    edit that does not load is reported once (``last_error``) and not tried again until the code
    changes again."""

    def __init__(self, code_dir: Path, version: str) -> None:
        self.code_dir = code_dir.resolve()
        self.version = version
        self.failed_version: str | None = None
        self.last_error: str | None = None

    def load(self) -> tuple[AgentT, str]:
        """The code dir's agent as it is now, and its code version; raises ``AgentLoadError``."""
        raise NotImplementedError

    def poll(self) -> tuple[AgentT, str] | None:
        try:
            current = code_version(self.code_dir)
        except OSError as exc:  # a file vanished between listing and reading: look again next time
            logger.debug("code dir changed while hashing: %s", exc)
            return None
        if current in (self.version, self.failed_version):
            return None
        try:
            agent, loaded = self.load()
        except AgentLoadError as exc:
            self.failed_version, self.last_error = current, str(exc)
            logger.error("the edit in %s does not load (%s); still running code %s", self.code_dir, exc, self.version)
            return None
        self.version, self.failed_version, self.last_error = loaded, None, None
        return agent, loaded


class CodeWatcher(Watcher[SwarmAgent]):
    """Hot swap of an agent imported in this process."""

    def load(self) -> tuple[SwarmAgent, str]:
        _forget_modules_under(self.code_dir)
        return load_agent(self.code_dir)
