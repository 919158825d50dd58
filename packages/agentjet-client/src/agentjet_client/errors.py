"""The client's exceptions, rooted in one class.

    AgentJetError
    ├── ServerError          the server answered with an error (status_code, message)
    │   ├── RejectedRequest  a 4xx: the request itself is wrong; retrying will not help
    │   ├── ServerBusy       a 429: no room now (a full training buffer); ``retry_after`` says when to ask again
    │   └── ServerStarting   a 503 from a server still starting (building or loading its model)
    ├── ServerUnreachable    no answer from the server (after retries)
    ├── AgentLoadError       the code dir has no usable @swarm_agent, or it fails to import
    ├── TaskLoadError        the agent's tasks could not be loaded (its own traceback in the message)
    └── StudyError           a research study file is invalid, or its --out dir belongs to another

Capture never raises into agent code: its failures are logged and counted on the recorder.

``extra_hint`` words what to tell a user whose optional extra does not import, for both packages. An extra
can fail in two ways, and the fix differs: its packages are not installed (install the extra), or they are
installed at a version that no longer has what we import (mcp 2 dropped ``FastMCP``: install a version the
extra's range allows). It tells them apart from the package's own metadata and always carries the real
``ImportError``, so neither case reads as "install the command you just ran".
"""

from __future__ import annotations

import re
from importlib import metadata


class AgentJetError(Exception):
    """Base of everything the client raises on purpose."""


class ServerError(AgentJetError):
    """The server answered with an error status (``status_code``) and this message."""

    def __init__(self, status_code: int, message: str) -> None:
        super().__init__(f"server answered {status_code}: {message}")
        self.status_code = status_code
        self.message = message


class RejectedRequest(ServerError):
    """The server refused the request as invalid (4xx)."""


class ServerBusy(ServerError):
    """The server has no room for the request now (429: its training buffer is full); ask again after
    ``retry_after`` seconds (its ``Retry-After``, when it gave one)."""

    def __init__(self, status_code: int, message: str, retry_after: float | None = None) -> None:
        super().__init__(status_code, message)
        self.retry_after = retry_after


class ServerStarting(ServerError):
    """The server listens but is still starting; the message says what it is doing."""


class ServerUnreachable(AgentJetError):
    """The server could not be reached."""


class AgentLoadError(AgentJetError):
    """The agent code could not be loaded."""


class TaskLoadError(AgentJetError):
    """Loading an agent's tasks raised: the message holds the traceback of the agent's own frames."""


class StudyError(AgentJetError):
    """A study file is invalid, or a study's output directory cannot be used as asked."""


class InputError(AgentJetError):
    """A command's input (a file, a flag) or its server's answer it cannot go on with: the message says what and
    how to fix it (the CLI prints it as every command's error line, exit code 2)."""


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def extra_requirements(package: str, extra: str) -> list[str]:
    """The requirements ``package`` declares for ``extra`` (``["mcp<2,>=1.20"]``), markers dropped."""
    try:
        declared = metadata.requires(package) or []
    except metadata.PackageNotFoundError:
        return []
    wanted = re.compile(r"""extra\s*==\s*["']""" + re.escape(extra) + r"""["']""")
    return [line.split(";")[0].strip() for line in declared if ";" in line and wanted.search(line.split(";", 1)[1])]


def _installed(requirement: str) -> str | None:
    found = _NAME.match(requirement)
    if found is None:
        return None
    name = found.group(0).split("[")[0]
    try:
        return f"{name} {metadata.version(name)}"
    except metadata.PackageNotFoundError:
        return None


def extra_hint(feature: str, extra: str, exc: ImportError, package: str = "agentjet-client") -> str:
    """One message for ``feature`` whose import of ``package[extra]`` raised ``exc``: what failed (the real
    error), what is installed against what the extra asks for, and the command that fixes it."""
    requirements = extra_requirements(package, extra)
    installed = [found for found in map(_installed, requirements) if found]
    error = f"{type(exc).__name__}: {exc}"
    install = f"pip install '{package}[{extra}]'"
    if requirements and len(installed) == len(requirements):
        # everything is there, yet the import failed: a version outside the range, or a broken install
        return (
            f"{feature} could not import what the {extra} extra brings ({error}); installed: {', '.join(installed)}, "
            f"while {package}[{extra}] asks for {', '.join(requirements)}: {install} puts a version it supports "
            "in place"
        )
    wants = f" ({', '.join(requirements)})" if requirements else ""
    return f"{feature} needs the {extra} extra{wants}: {install} ({error})"
