"""Load the ``@swarm_agent`` from a code directory, and fingerprint that code.

``DIR/agent.py`` is imported if it exists, else the single ``*.py`` file in DIR that defines a
``SwarmAgent``. DIR goes on ``sys.path`` so the agent can import its sibling modules. The code
version is a hash of every ``*.py`` file under DIR, so a trajectory says which code made it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import traceback
from pathlib import Path
from types import ModuleType

from agentjet_client.agent import SwarmAgent
from agentjet_client.errors import AgentLoadError


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
