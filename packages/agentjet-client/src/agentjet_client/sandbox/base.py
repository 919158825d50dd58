"""A sandbox per episode, behind one small interface: start, exec, read and write a file, copy in and out, stop.

Paths are the sandbox's own (``/app``, ``/tests``, ``/logs/verifier``); what a backend keeps them in is its
business. A sandbox runs one command at a time (its methods wait for each other), so a file the caller reads
between commands cannot change under it. ``async with`` starts it and stops it on every way out.

    async with LocalSandbox(task.limits) as box:
        done = await box.exec("ls /app", timeout=10)
        print(done.exit_code, done.stdout)

Backends: ``local`` (bubblewrap, ``sandbox.local``). A container backend (docker, podman) fits the same
interface: ``start`` runs a container from the task's image with the same mounts, ``exec`` is ``docker exec``,
the files go through ``docker cp``; it is not built here, as this machine runs no container engine.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from agentjet_client.errors import AgentJetError

MAX_OUTPUT = 1 << 20  # bytes of stdout (and of stderr) an exec keeps: the rest is cut, and said to be


class SandboxError(AgentJetError):
    """The sandbox could not do what was asked (it cannot start, a path leaves it, it is stopped)."""


@dataclass(frozen=True)
class Limits:
    """What one sandbox may use: seconds a command may run (killed past it), memory and processes (enforced
    where the host allows: see the backend)."""

    timeout_s: float = 600.0
    memory_mb: int | None = 2048
    max_processes: int | None = 256


@dataclass(frozen=True)
class ExecResult:
    """A command's end: its exit status (-9 when killed past its timeout), its output (each at most
    ``MAX_OUTPUT`` bytes, decoded as UTF-8 with replacement) and how long it ran."""

    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool
    seconds: float

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


class Sandbox(ABC):
    """One episode's sandbox (see the module docstring)."""

    @abstractmethod
    async def start(self) -> None:
        """Make it ready for commands (directories, limits); idempotent."""

    @abstractmethod
    async def exec(
        self, command: str, *, timeout: float | None = None, cwd: str = "/app", env: dict[str, str] | None = None
    ) -> ExecResult:
        """Run ``command`` with ``bash -c`` inside, at most ``timeout`` seconds (else the sandbox's)."""

    @abstractmethod
    async def read_file(self, path: str) -> bytes:
        """The bytes of the file at ``path`` inside."""

    @abstractmethod
    async def write_file(self, path: str, data: bytes | str) -> None:
        """Write ``data`` to ``path`` inside (its directories made as needed)."""

    @abstractmethod
    async def copy_in(self, source: Path, path: str) -> None:
        """Copy the host's file or directory ``source`` to ``path`` inside."""

    @abstractmethod
    async def copy_out(self, path: str, destination: Path) -> None:
        """Copy the file or directory at ``path`` inside to the host's ``destination``."""

    @abstractmethod
    async def stop(self) -> None:
        """Kill what runs inside and remove everything the sandbox holds; idempotent."""

    async def __aenter__(self) -> Sandbox:
        await self.start()
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()
