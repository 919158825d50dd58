"""``@swarm_agent``: mark the function that runs one episode, and where its tasks come from.

    @swarm_agent(tasks=lambda: [{"id": "t1", "question": "..."}])
    async def solve(task, episode):
        llm = episode.async_openai()
        ...
        return reward

The function takes ``(task, episode)`` and returns the episode's reward (a number; a bool
counts as 0/1). It may be sync or async. ``tasks`` is a list of dicts or a callable returning
an iterable of dicts; each task's ``"id"`` (or its index) is its GRPO group key.
``eval_tasks`` (same form) are held-out tasks for evaluation episodes (``agentjet-client run
--eval-every``, ``agentjet-client eval``): the server records their rewards by policy version and
never trains them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentjet_client.errors import TaskLoadError
from agentjet_client.failures import describe

Task = dict[str, Any]
TaskSource = Iterable[Task] | Callable[[], Iterable[Task]]


@dataclass
class SwarmAgent:
    fn: Callable[..., Any]
    tasks: TaskSource
    name: str
    tag: str | None = None
    eval_tasks: TaskSource | None = None

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.fn)

    def load_tasks(self, evaluation: bool = False) -> list[tuple[str, Task]]:
        """``(task id, task)`` pairs (of ``eval_tasks`` with ``evaluation``); raises ValueError when
        the source yields nothing usable."""
        if evaluation and self.eval_tasks is None:
            raise ValueError(
                f"agent '{self.name}' has no evaluation tasks; give @swarm_agent(eval_tasks=...) held-out tasks"
            )
        tasks = self.eval_tasks if evaluation else self.tasks
        assert tasks is not None
        kind = "eval_tasks" if evaluation else "tasks"
        try:
            source = list(tasks() if callable(tasks) else tasks)
        except Exception as exc:  # the agent's own code: say where in it
            failure = describe(exc)
            raise TaskLoadError(
                f"loading the {kind} of agent '{self.name}' failed: {failure.trace}{self._beside_hint(exc)}"
            ) from exc
        out = []
        for index, task in enumerate(source):
            if not isinstance(task, dict):
                raise ValueError(f"task {index} of agent '{self.name}' is a {type(task).__name__}; tasks must be dicts")
            out.append((str(task.get("id", f"task-{index}")), task))
        if not out:
            raise ValueError(f"agent '{self.name}' has no {kind}; give @swarm_agent({kind}=...) a non-empty list")
        return out

    def _beside_hint(self, exc: Exception) -> str:
        """For a relative path opened from the directory ``run`` started in while the file is beside the
        agent: how to open it wherever ``run`` starts."""
        name = getattr(exc, "filename", None) if isinstance(exc, FileNotFoundError) else None
        if not isinstance(name, str) or Path(name).is_absolute():
            return ""
        try:
            beside = Path(inspect.getfile(self.fn)).resolve().parent
        except (TypeError, OSError):
            return ""
        if not (beside / name).exists():
            return ""
        return (
            f"\n{name} is not in the directory `run` started in ({Path.cwd()}) but beside the agent, in {beside}; "
            f"relative paths are opened from where `run` starts: open it as Path(__file__).parent / {name!r}"
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


def swarm_agent(
    fn: Callable[..., Any] | None = None,
    *,
    tasks: TaskSource,
    name: str | None = None,
    tag: str | None = None,
    eval_tasks: TaskSource | None = None,
) -> Any:
    """Decorator: turn ``fn(task, episode) -> reward`` into a ``SwarmAgent``."""

    def wrap(f: Callable[..., Any]) -> SwarmAgent:
        params = inspect.signature(f).parameters
        if len(params) < 2:
            raise TypeError(f"@swarm_agent function '{f.__name__}' must take (task, episode)")
        return SwarmAgent(fn=f, tasks=tasks, name=name or f.__name__, tag=tag, eval_tasks=eval_tasks)

    return wrap(fn) if fn is not None else wrap
