"""``@swarm_agent``: mark the function that runs one episode, and where its tasks come from.

    @swarm_agent(tasks="tasks.jsonl", eval_tasks=0.1)
    async def solve(task, episode):
        llm = episode.async_openai()
        ...
        return reward

The function takes ``(task, episode)`` and returns the episode's reward (a number; a bool
counts as 0/1). It may be sync or async. ``tasks`` is a list of dicts, a callable returning
an iterable of dicts, or a task file or saved dataset (JSONL, JSON, CSV, Parquet, a ``datasets``
directory; a relative path is read from beside the agent's file): ``tasks.sources`` says how each is
read. Each task's ``"id"`` (or its index) is its GRPO group key.
``eval_tasks`` are held-out tasks for evaluation episodes (``agentjet-client run --eval-every``,
``agentjet-client eval``): the server records their rewards by policy version and never trains
them. They are a source of the same forms, a fraction of ``tasks`` to hold out (``0.1``), or the
name of another split of the same saved dataset (``"test"``, with ``split="train"``).
``reward`` takes the reward out of the function: it returns its result, and reward functions
(``rewards.Rubric``) or an LLM judge (``judges.Judge``, ``judges.GroupJudge``) score it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentjet_client.tasks.judges import Judge
from agentjet_client.tasks.rewards import Rubric, as_rubric
from agentjet_client.tasks.sources import EvalSource, Task, TaskSource, TaskSpec

__all__ = ["SwarmAgent", "Task", "TaskSource", "swarm_agent"]


@dataclass
class SwarmAgent:
    fn: Callable[..., Any]
    tasks: TaskSource | None  # None: the run's own source gives them (``run --tasks FILE``)
    name: str
    tag: str | None = None
    eval_tasks: EvalSource | None = None
    split: str | None = None
    reward: Any = None  # a reward stage: a function, a ``Rubric``, a ``Judge`` (the function returns its result)
    home_dir: Path | None = None  # where relative task paths are read (default: the function's file's directory)

    @property
    def rubric(self) -> Rubric | None:
        """The per-episode reward functions, scored where the episode runs."""
        return as_rubric(self.reward)

    @property
    def judge(self) -> Judge | None:
        """The LLM judge that rewards the episodes after they are spooled (``judging``)."""
        return self.reward if isinstance(self.reward, Judge) else None

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.fn)

    @property
    def home(self) -> Path | None:
        """The directory of the file that defines the agent: relative task paths are read from there."""
        if self.home_dir is not None:
            return self.home_dir
        try:
            return Path(inspect.getfile(self.fn)).resolve().parent
        except (TypeError, OSError):
            return None

    @property
    def task_spec(self) -> TaskSpec:
        return TaskSpec(self.tasks, self.eval_tasks, self.split, self.home, f"agent '{self.name}'")

    def load_tasks(self, evaluation: bool = False) -> list[tuple[str, Task]]:
        """``(task id, task)`` pairs (of ``eval_tasks`` with ``evaluation``); raises ValueError when
        the source yields nothing usable, TaskLoadError when it cannot be read."""
        return self.task_spec.load(evaluation)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


def swarm_agent(
    fn: Callable[..., Any] | None = None,
    *,
    tasks: TaskSource | None = None,
    name: str | None = None,
    tag: str | None = None,
    eval_tasks: EvalSource | None = None,
    split: str | None = None,
    reward: Any = None,
) -> Any:
    """Decorator: turn ``fn(task, episode) -> reward`` into a ``SwarmAgent``; with ``reward`` (a function,
    a ``Rubric``, a ``Judge`` or ``GroupJudge``), ``fn`` returns its result and ``reward`` scores it.
    Without ``tasks``, the tasks come from the command line (``run --tasks FILE``, ``try --tasks FILE``)."""

    def wrap(f: Callable[..., Any]) -> SwarmAgent:
        params = inspect.signature(f).parameters
        if len(params) < 2:
            raise TypeError(f"@swarm_agent function '{f.__name__}' must take (task, episode)")
        agent = SwarmAgent(f, tasks, name or f.__name__, tag, eval_tasks, split, reward)
        agent.task_spec  # noqa: B018  (a bad eval_tasks fraction or reward is refused where the agent is defined)
        agent.rubric  # noqa: B018
        return agent

    return wrap(fn) if fn is not None else wrap
