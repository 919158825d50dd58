"""Sandboxes for agents that act on a machine: terminal tasks in Harbor's format, one sandbox per episode,
the reward from the task's tests (docs/sandboxes.md).

    from agentjet_client.sandbox import task_sandbox, verify

    @swarm_agent(tasks="tasks/")              # a directory of task directories
    async def agent(task, episode):
        async with task_sandbox(task) as (box, terminal):
            ...                                # the model's commands: await box.exec(command)
            return (await verify(box, terminal)).reward
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from agentjet_client.sandbox.base import ExecResult, Limits, Sandbox, SandboxError
from agentjet_client.sandbox.local import LocalSandbox, clean_stale
from agentjet_client.sandbox.tasks import (
    TerminalTask,
    Verdict,
    is_task_set,
    prepare,
    read_task,
    read_task_dirs,
    run_oracle,
    verify,
)

__all__ = [
    "ExecResult",
    "Limits",
    "LocalSandbox",
    "Sandbox",
    "SandboxError",
    "TerminalTask",
    "Verdict",
    "clean_stale",
    "is_task_set",
    "read_task",
    "read_task_dirs",
    "run_oracle",
    "task_sandbox",
    "verify",
]


@asynccontextmanager
async def task_sandbox(
    task: TerminalTask | Mapping[str, Any], root: Path | None = None
) -> AsyncIterator[tuple[Sandbox, TerminalTask]]:
    """A started local sandbox with ``task``'s environment in place (a ``TerminalTask``, or the task dict a task
    set gives an agent), and the task; stopped on every way out. Refused (``SandboxError``) for a task whose
    Dockerfile installs what this host lacks."""
    terminal = task if isinstance(task, TerminalTask) else read_task(Path(str(task["task_dir"])))
    lacking = await asyncio.to_thread(terminal.missing)
    if lacking:
        raise SandboxError(
            f"task {terminal.name} installs what this host lacks ({', '.join(lacking)}): the local sandbox runs on "
            "the host's own system, so install these here, or run the task where a container backend builds its image"
        )
    async with LocalSandbox(terminal.limits, root) as box:
        await prepare(box, terminal)
        yield box, terminal
