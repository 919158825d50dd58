"""Rewards apart from the agent: reward functions composed with weights (``Rubric``).

With ``@swarm_agent(reward=...)`` the agent's function returns its *result* (an answer, a dict, anything
the reward needs) instead of a number, and the reward is computed from it:

    def correct(task, result):
        return float(result.strip() == task["answer"])

    def short(result):
        return 1.0 if len(result) <= 20 else 0.0

    @swarm_agent(tasks="questions.jsonl", reward=Rubric([(correct, 1.0), (short, 0.2)]))
    async def answer(task, episode):
        reply = await episode.async_openai().chat.completions.create(...)
        return reply.choices[0].message.content

A reward function takes any of ``task``, ``result`` and ``episode`` by name and returns a number; it may
be ``async``. The episode's reward is the weighted sum; each function's score is recorded with the
trajectory (``metadata["reward_components"]``, by the function's name) and the server plots each
component's mean. A function that raises fails the episode with its error and traceback, as the agent's
own exception does: a reward that could not be computed is never a silent 0. A plain function given as
``reward=`` is a rubric of that one function. LLM judges (``judges.Judge``, ``judges.GroupJudge``) are
given the same way.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from agentjet_client.tasks.judges import Judge

ARGUMENTS = ("task", "result", "episode")


@dataclass
class Scored:
    """An episode's reward as a reward stage computed it: the total, and each component's score."""

    reward: float
    components: dict[str, float] = field(default_factory=dict)


def _name_of(fn: Callable[..., Any]) -> str:
    return str(getattr(fn, "__name__", None) or type(fn).__name__)


def _wanted(fn: Callable[..., Any]) -> tuple[str, ...]:
    """The arguments ``fn`` takes, all of them among ``ARGUMENTS`` (or ``**kwargs``: all three)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError) as exc:
        raise TypeError(f"reward function {fn!r} has no signature to read: {exc}") from None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return ARGUMENTS
    names = tuple(name for name, p in params.items() if p.kind is not inspect.Parameter.VAR_POSITIONAL)
    unknown = [name for name in names if name not in ARGUMENTS and params[name].default is inspect.Parameter.empty]
    if unknown:
        raise TypeError(
            f"reward function {_name_of(fn)} takes {', '.join(unknown)}; a reward function takes any of "
            f"{', '.join(ARGUMENTS)} by name"
        )
    return tuple(name for name in names if name in ARGUMENTS)


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float) and math.isfinite(value):
        return float(value)
    raise TypeError(f"reward function {name} returned {value!r}; a reward function returns a finite number")


class Rubric:
    """Reward functions with weights: ``Rubric([(correct, 1.0), (short, 0.2)])`` (a bare function weighs 1).
    The reward is the weighted sum of their scores; each score is kept by the function's name."""

    def __init__(self, parts: Sequence[tuple[Callable[..., Any], float] | Callable[..., Any]]) -> None:
        self.parts: list[tuple[str, Callable[..., Any], float, tuple[str, ...]]] = []
        for part in parts:
            fn, weight = part if isinstance(part, tuple) else (part, 1.0)
            if not callable(fn):
                raise TypeError(f"a rubric part is (function, weight); {fn!r} is not a function")
            if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight):
                raise TypeError(f"the weight of {_name_of(fn)} is {weight!r}; weights are finite numbers")
            name = _name_of(fn)
            if any(name == known for known, *_ in self.parts):
                raise ValueError(f"two reward functions are named {name}; each component needs its own name")
            self.parts.append((name, fn, float(weight), _wanted(fn)))
        if not self.parts:
            raise ValueError("a Rubric needs at least one reward function")

    async def score(self, task: Any, result: Any, episode: Any) -> Scored:
        given = {"task": task, "result": result, "episode": episode}
        components: dict[str, float] = {}
        total = 0.0
        for name, fn, weight, wanted in self.parts:
            value = fn(**{arg: given[arg] for arg in wanted})
            if inspect.isawaitable(value):
                value = await value
            components[name] = _number(value, name)
            total += weight * components[name]
        return Scored(total, components)

    def score_sync(self, task: Any, result: Any, episode: Any) -> Scored:
        """``score`` from synchronous code (a worker process): async reward functions run to completion."""
        return asyncio.run(self.score(task, result, episode))


def as_rubric(reward: Any) -> Rubric | None:
    """``@swarm_agent(reward=...)`` as a ``Rubric`` (None: no reward stage, or a judge)."""
    if reward is None or isinstance(reward, Rubric | Judge):
        return reward if isinstance(reward, Rubric) else None
    if callable(reward):
        return Rubric([(reward, 1.0)])
    raise TypeError(f"reward={reward!r}: give a function, a Rubric, a Judge or a GroupJudge")
