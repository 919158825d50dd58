"""Terminal tasks in Harbor's directory format, and their reward from tests.

A task is a directory:

    my-task/
      instruction.md          what the agent is told (the task's ``instruction``)
      task.toml               its limits and metadata (below)
      environment/Dockerfile  how its image is built; the local backend reads it (below)
      tests/test.sh           the verifier: run after the agent, in the same sandbox
      solution/solve.sh       optional: the reference solution (the ``oracle``)

A directory of such directories is a task set (``run --tasks DIR``): one task per directory that holds a
``task.toml``, its id the directory's name.

Of ``task.toml`` we honour ``[agent] timeout_sec`` (a command's and the episode's limit), ``[verifier]
timeout_sec`` and ``env``, and ``[environment] memory_mb`` (the sandbox's memory); ``[metadata]`` is kept with
the task; ``version``, ``build_timeout_sec``, ``cpus`` and ``storage_mb`` are read and ignored (the local
backend builds no image and shares the host's cores and disk).

Of the ``Dockerfile`` the local backend, which has no image to build (the host's system stands in for it),
honours ``COPY``/``ADD`` of files of ``environment/`` into ``/app`` (copied in at start) and checks what
``RUN`` lines install: ``apt-get install`` / ``apt install`` packages must be installed on the host
(dpkg), ``pip install`` packages importable by the host's ``python3``; a task that installs anything the host
lacks is refused, naming it (``missing``). ``FROM``, ``WORKDIR``, ``ENV`` and other ``RUN`` lines are ignored.

The reward (``verify``): ``tests/`` is copied to ``/tests`` and ``bash /tests/test.sh`` runs from ``/app``;
the reward is the number in ``/logs/verifier/reward.txt``, else ``reward.json`` (a number, or an object
whose ``reward`` it is), else 1.0 when the script exits 0 and 0.0 otherwise.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentjet_client.errors import TaskLoadError
from agentjet_client.sandbox.base import ExecResult, Limits, Sandbox

DEFAULT_AGENT_TIMEOUT_S = 600.0
DEFAULT_VERIFIER_TIMEOUT_S = 600.0
_INSTALLS = {
    "apt": re.compile(r"\bapt(?:-get)?\s+(?:-\S+\s+)*install\b(.*)"),
    "pip": re.compile(r"\b(?:uv\s+)?pip3?\s+install\b(.*)"),
}


@dataclass(frozen=True)
class TerminalTask:
    """One task directory, as read (see the module docstring)."""

    name: str
    directory: Path
    instruction: str
    agent_timeout_s: float = DEFAULT_AGENT_TIMEOUT_S
    verifier_timeout_s: float = DEFAULT_VERIFIER_TIMEOUT_S
    verifier_env: dict[str, str] = field(default_factory=dict)
    memory_mb: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def limits(self) -> Limits:
        return Limits(timeout_s=self.agent_timeout_s, memory_mb=self.memory_mb or Limits.memory_mb)

    def as_task(self) -> dict[str, Any]:
        """The task as a run's task source gives it to an agent (``read_task`` reads it back)."""
        return {"id": self.name, "instruction": self.instruction, "task_dir": str(self.directory)}

    def copies(self) -> list[tuple[Path, str]]:
        """The Dockerfile's ``COPY``/``ADD`` of ``environment/`` files: ``(host path, path inside)``."""
        out = []
        for words in _instructions(self.directory, ("COPY", "ADD")):
            args = [w for w in words if not w.startswith("--")]
            if len(args) < 2:
                continue
            *sources, target = args
            for source in sources:
                host = (self.directory / "environment" / source).resolve()
                if not host.is_relative_to((self.directory / "environment").resolve()) or not host.exists():
                    raise TaskLoadError(f"{self.name}: the Dockerfile copies {source!r}, which environment/ lacks")
                inside = target if target.startswith("/") else f"/app/{target}"
                if target.endswith("/") or len(sources) > 1:
                    inside = f"{inside.rstrip('/')}/{host.name}"
                out.append((host, inside))
        return out

    def missing(self) -> list[str]:
        """What the Dockerfile installs that this host lacks (``apt: name``, ``pip: name``)."""
        wanted: dict[str, list[str]] = {"apt": [], "pip": []}
        for words in _instructions(self.directory, ("RUN",)):
            line = " ".join(words)
            for kind, pattern in _INSTALLS.items():
                for found in pattern.finditer(line):
                    names = re.split(r"&&|;|\|\|", found.group(1))[0]
                    wanted[kind] += [n for n in shlex.split(names) if not n.startswith("-") and "=" not in n[:1]]
        lacking = [f"apt: {name}" for name in wanted["apt"] if not _dpkg_has(name.split("=")[0])]
        lacking += [f"pip: {name}" for name in _python_lacks([re.split(r"[<>=!~\[]", n)[0] for n in wanted["pip"]])]
        return lacking


def _instructions(directory: Path, keywords: tuple[str, ...]) -> list[list[str]]:
    """The Dockerfile's instructions of ``keywords``, continuation lines joined, as words."""
    dockerfile = directory / "environment" / "Dockerfile"
    if not dockerfile.is_file():
        return []
    text = re.sub(r"\\\n", " ", dockerfile.read_text(encoding="utf-8"))
    out = []
    for line in text.splitlines():
        words = line.strip().split()
        if words and words[0].upper() in keywords:
            out.append(words[1:])
    return out


def _dpkg_has(package: str) -> bool:
    return any(Path("/var/lib/dpkg/info").glob(f"{package}.list")) or any(
        Path("/var/lib/dpkg/info").glob(f"{package}:*.list")
    )


def _python_lacks(names: list[str]) -> list[str]:
    """Of the distributions ``names``, those the host's ``python3`` (the one sandboxes run) does not have."""
    if not names:
        return []
    probe = (
        "import importlib.metadata as m, sys\nfor n in sys.argv[1:]:\n  try: m.version(n)\n  except Exception: print(n)"
    )
    done = subprocess.run(["python3", "-c", probe, *names], capture_output=True, text=True, timeout=60, check=False)
    return done.stdout.split() if done.returncode == 0 else names


def read_task(directory: Path) -> TerminalTask:
    """The task in ``directory`` (see the module docstring); ``TaskLoadError`` saying what is wrong."""
    config_file, instruction = directory / "task.toml", directory / "instruction.md"
    for needed in (config_file, instruction, directory / "tests" / "test.sh"):
        if not needed.is_file():
            raise TaskLoadError(f"{directory} is not a task directory: it has no {needed.relative_to(directory)}")
    try:
        config = tomllib.loads(config_file.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise TaskLoadError(f"{config_file}: not TOML ({exc})") from None
    agent, verifier, environment = (config.get(part) or {} for part in ("agent", "verifier", "environment"))
    try:
        return TerminalTask(
            name=directory.name,
            directory=directory.resolve(),
            instruction=instruction.read_text(encoding="utf-8").strip(),
            agent_timeout_s=float(agent.get("timeout_sec", DEFAULT_AGENT_TIMEOUT_S)),
            verifier_timeout_s=float(verifier.get("timeout_sec", DEFAULT_VERIFIER_TIMEOUT_S)),
            verifier_env={str(k): str(v) for k, v in (verifier.get("env") or {}).items()},
            memory_mb=int(environment["memory_mb"]) if "memory_mb" in environment else None,
            metadata=dict(config.get("metadata") or {}),
        )
    except (TypeError, ValueError) as exc:
        raise TaskLoadError(f"{config_file}: a limit is not a number ({exc})") from None


def is_task_set(path: Path) -> bool:
    """Whether ``path`` is a task directory, or a directory holding task directories."""
    return (path / "task.toml").is_file() or any(p.is_file() for p in path.glob("*/task.toml"))


def read_task_dirs(path: Path) -> list[TerminalTask]:
    """The tasks of a task set (one directory, or a directory of them), in name order."""
    if (path / "task.toml").is_file():
        return [read_task(path)]
    return [read_task(found.parent) for found in sorted(path.glob("*/task.toml"))]


@dataclass(frozen=True)
class Verdict:
    """The verifier's answer: the reward, where it came from, and the test script's run."""

    reward: float
    source: str  # reward.txt, reward.json or exit status
    run: ExecResult


async def prepare(box: Sandbox, task: TerminalTask) -> None:
    """Put the task's environment in a started sandbox (its Dockerfile's copies)."""
    for host, inside in task.copies():
        await box.copy_in(host, inside)


async def verify(box: Sandbox, task: TerminalTask) -> Verdict:
    """Run the task's tests in ``box`` after the agent, and read the reward (see the module docstring)."""
    await box.copy_in(task.directory / "tests", "/tests")
    await box.exec("mkdir -p /logs/verifier", timeout=30)
    run = await box.exec("bash /tests/test.sh", timeout=task.verifier_timeout_s, env=task.verifier_env)
    for name in ("reward.txt", "reward.json"):
        try:
            text = (await box.read_file(f"/logs/verifier/{name}")).decode().strip()
        except Exception:  # absent (or unreadable): the next source
            continue
        value = _reward_of(text, name)
        if value is not None:
            return Verdict(value, name, run)
    return Verdict(1.0 if run.ok else 0.0, "exit status", run)


def _reward_of(text: str, name: str) -> float | None:
    try:
        value = json.loads(text) if name.endswith(".json") else float(text)
    except ValueError:
        return None
    if isinstance(value, dict):
        value = value.get("reward")
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


async def run_oracle(box: Sandbox, task: TerminalTask) -> ExecResult:
    """Run the task's reference solution (``solution/solve.sh``) in ``box``, as an agent would act."""
    if not (task.directory / "solution" / "solve.sh").is_file():
        raise TaskLoadError(f"{task.name} has no solution/solve.sh to run as the oracle")
    await box.copy_in(task.directory / "solution", "/solution")
    return await box.exec("bash /solution/solve.sh", timeout=task.agent_timeout_s)
