"""What a researcher's plan becomes on disk, and the checks it must pass before it trains.

A plan names agent-code *variants* (each the user's code dir with some files replaced: a reward
function, an environment wrapper, a prompt) and a study file over them. ``write_round`` puts them
under the round's directory: ``variants/<name>/`` (a copy of the code dir, the variant's files on
top) and ``study.toml``. ``check_round`` then proves them, each in an interpreter and working
directory of its own, never in this process:

* every variant's agent imports and plays one episode against a serving model (``agentjet-client
  try``) and returns a reward;
* the study file validates (``agentjet-client research check``) and plans no more trials than the
  budget has left;
* no path in the study reaches outside the research directory (a model or reference may be read
  from anywhere; nothing may be written outside).

Every failure comes back as a sentence the researcher can act on.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

from agentjet_client.errors import StudyError
from agentjet_client.research.tools import ToolError, Workspace
from agentjet_client.research.trial import Process, default_signals

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
READ_ONLY_KEYS = ("model", "reference", "chat_template")  # paths a study may read from anywhere
TRY_TIMEOUT_S = 180.0
MAX_FILE_CHARS = 200_000


def write_round(folder: Path, code_dir: Path, plan: dict[str, Any]) -> list[str]:
    """The plan's variants and study file under ``folder``; problems with the plan's shape (names,
    file paths), or [] when it is all written."""
    problems = []
    variants = plan.get("variants")
    study = plan.get("study")
    if not isinstance(variants, dict) or not variants:
        problems.append('"variants" must be an object of NAME -> {"files": {PATH: TEXT}} with at least one variant')
        variants = {}
    if not isinstance(study, str) or not study.strip():
        problems.append('"study" must be the study file as TOML text')
    folder.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(folder / "variants", ignore_errors=True)
    for name, variant in variants.items():
        if not NAME.match(str(name)):
            problems.append(f"variant name {name!r}: use letters, digits, - and _ (it becomes a directory)")
            continue
        files = (variant or {}).get("files", {}) if isinstance(variant, dict) else None
        if not isinstance(files, dict):
            problems.append(f'variant {name}: "files" must map relative paths to file texts')
            continue
        target = folder / "variants" / name
        shutil.copytree(code_dir, target, ignore=shutil.ignore_patterns("__pycache__", ".*"))
        for relative, text in files.items():
            path = (target / str(relative)).resolve()
            if target.resolve() not in path.parents or not isinstance(text, str):
                problems.append(
                    f"variant {name}: file {relative!r} must be a relative path inside the code dir, with text"
                )
                continue
            if len(text) > MAX_FILE_CHARS:
                problems.append(f"variant {name}: {relative} is over {MAX_FILE_CHARS} characters")
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if isinstance(study, str):
        (folder / "study.toml").write_text(study)
    return problems


def check_round(
    folder: Path, out: Path, workspace: Workspace, server: str, trials_left: int | None
) -> tuple[list[str], dict[str, Any] | None]:
    """Check the round's variants and study (see the module's docstring): the problems found, and
    what the study plans when it validates."""
    problems = []
    for variant in sorted((folder / "variants").iterdir()) if (folder / "variants").is_dir() else []:
        problem = try_variant(variant, folder / "checks" / variant.name, server)
        if problem:
            problems.append(f"variant {variant.name}: {problem}")
    plan = None
    study = folder / "study.toml"
    if study.exists():
        problems += outside_paths(study, out)
        try:
            plan = workspace.check_study(str(study.relative_to(workspace.root)))
        except ToolError as exc:
            problems.append(f"study.toml: {exc}")
        else:
            if trials_left is not None and plan["trials"] > trials_left:
                problems.append(
                    f"study.toml plans {plan['trials']} trials and the budget has {trials_left} left: plan at most "
                    f"{trials_left}"
                )
            outside = [d for d in plan["code_dirs"] if (folder / "variants") not in Path(d).parents]
            if outside:
                problems.append(
                    f"study.toml: every code_dir must be one of the variants (variants/NAME); {outside[0]} is not"
                )
    return problems, plan


def try_variant(code_dir: Path, workdir: Path, server: str) -> str | None:
    """One episode of the agent in ``code_dir`` (``agentjet-client try``, its own interpreter, its
    own working directory); why it failed, or None."""
    workdir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "agentjet_client", "try", "--code-dir", str(code_dir), "--server", server]
    command += ["--timeout", str(TRY_TIMEOUT_S / 2)]
    try:
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=TRY_TIMEOUT_S,
            cwd=str(workdir),
            env={**os.environ, "COLUMNS": "200", "PYTHONDONTWRITEBYTECODE": "1"},
        )
    except subprocess.TimeoutExpired:
        return f"one episode did not finish within {TRY_TIMEOUT_S:.0f}s"
    output = (done.stdout + done.stderr).strip()
    (workdir / "try.log").write_text(output + "\n")
    if done.returncode == 0:
        return None
    lines = [line for line in output.splitlines() if line.strip()]
    return f"one episode failed (exit {done.returncode}): " + " | ".join(lines[-12:])[-2500:]


def outside_paths(study: Path, out: Path) -> list[str]:
    """Paths in the study file that reach outside ``out`` (except models read from anywhere)."""
    try:
        data = tomllib.loads(study.read_text())
    except tomllib.TOMLDecodeError:
        return []  # the study check says what is wrong with it
    problems = []
    for key, value in _leaves(data):
        name = key.rsplit(".", 1)[-1]
        if name in READ_ONLY_KEYS or not isinstance(value, str) or ("/" not in value and value not in ("..", "~")):
            continue
        path = (study.parent / os.path.expanduser(value)).resolve()
        if path != out.resolve() and out.resolve() not in path.parents:
            problems.append(f"study.toml: {key} = {value!r} is outside the research directory; keep every path in it")
    return problems


def _leaves(data: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(data, dict):
        return [leaf for key, value in data.items() for leaf in _leaves(value, f"{prefix}{key}.")]
    if isinstance(data, list):
        return [leaf for value in data for leaf in _leaves(value, prefix)]
    return [(prefix.rstrip("."), data)]


class CheckServer:
    """A server the checks play their episodes against: a given URL, or the embedded model serving
    only (``agentjet-server up --serve-only``, state under ``out``), started when first needed."""

    def __init__(self, out: Path, url: str | None = None) -> None:
        self.out = out
        self._check_url = url
        self._check_process: subprocess.Popen[bytes] | None = None

    def url(self) -> str:
        """A server the checks play their episodes against: --check-server, or the embedded model
        serving only (started once, stopped when the loop ends)."""
        if self._check_url:
            return self._check_url
        from agentjet_client.research.launch import free_port

        port = free_port()
        log = self.out / "check-server.log"
        command = [*_server_program(), "up", "--serve-only", "--port", str(port), "--log-level", "warning"]
        command += ["--state-dir", str(self.out / "check-server"), "--fresh"]
        process = Process.spawn(command, log, dict(os.environ), str(self.out), preexec=_die_with_parent)
        self._check_process = process.popen
        assert self._check_process is not None
        url = f"http://127.0.0.1:{port}"
        import httpx2

        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self._check_process.poll() is not None:
                from agentjet_client.research.trial import last_lines

                raise StudyError(f"the check server exited: {last_lines(log)}")
            try:
                if httpx2.get(url + "/healthz", timeout=2).status_code == 200:
                    self._check_url = url
                    return url
            except httpx2.HTTPError:
                pass
            time.sleep(0.5)
        raise StudyError(f"the check server did not answer within 300s; see {log}")

    def stop(self) -> None:
        if self._check_process is None:
            return
        if self._check_process.poll() is None:
            self._check_process.send_signal(signal.SIGTERM)
            try:
                self._check_process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._check_process.kill()
        self._check_process = None
        self._check_url = None  # the one it started


def _die_with_parent() -> None:
    """In the check server's process before exec (Linux): SIGTERM when the loop's process dies, even
    by SIGKILL, so a killed loop leaves no server behind (elsewhere it is stopped on a clean exit)."""
    default_signals()
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _server_program() -> list[str]:
    import shutil

    found = shutil.which("agentjet-server") or shutil.which("agentjet-server", path=str(Path(sys.executable).parent))
    if found is None:
        raise StudyError(
            "checks need agentjet-server to serve a model: pip install agentjet-server, or --check-server URL"
        )
    return [found]
