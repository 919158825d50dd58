"""A gymnasium text environment as an agent: each observation becomes a user message, each model reply
an action, the environment's rewards the episode's reward.

    import gymnasium
    from agentjet_client.envs.gym import gym_agent

    agent = gym_agent("MyTextEnv-v0", tasks=[{"id": f"seed-{i}", "seed": i} for i in range(100)],
                      system="You play a guessing game.", max_turns=4)

One episode: ``env.reset(seed=task["seed"])`` (and ``options=task["options"]`` if given), then turns of
(the conversation so far -> the model's reply -> ``env.step(action(reply))``) until the environment
terminates or truncates, or ``max_turns``. The conversation keeps every reply as the model wrote it, so
each call continues the one before and the episode trains as one timeline. The reward is the sum of
the step rewards. ``observation`` turns an observation into message text (``str`` by default) and
``action`` a reply into an action (the text itself by default); ``env`` is an environment id for
``gymnasium.make`` (with ``task["env_kwargs"]``) or a callable that makes one. Steps run in a thread, so
a slow environment does not hold up the runner's other episodes. Needs ``pip install gymnasium``.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentjet_client.errors import extra_hint
from agentjet_client.tasks.agent import SwarmAgent, swarm_agent
from agentjet_client.tasks.sources import EvalSource, TaskSource


def _maker(env: str | Callable[..., Any]) -> Callable[[dict[str, Any]], Any]:
    if callable(env):
        return lambda task: env()
    try:
        import gymnasium
    except ImportError as exc:
        raise ImportError(extra_hint("gym_agent", "gym", exc)) from exc
    return lambda task: gymnasium.make(env, **task.get("env_kwargs", {}))


def gym_agent(
    env: str | Callable[..., Any],
    *,
    tasks: TaskSource,
    eval_tasks: EvalSource | None = None,
    name: str = "gym",
    tag: str | None = None,
    system: str | None = None,
    max_turns: int = 8,
    observation: Callable[[Any], str] = str,
    action: Callable[[str], Any] = lambda text: text,
    model: str = "agentjet-tiny",
    **sampling: Any,
) -> SwarmAgent:
    """The agent that plays ``env`` (see the module docstring); ``sampling`` goes to each chat completion
    (``max_tokens``, ``temperature``...)."""
    if max_turns < 1:
        raise ValueError("max_turns must be at least 1")
    make = _maker(env)

    async def play(task: dict[str, Any], episode: Any) -> float:
        environment = make(task)
        try:
            reset: dict[str, Any] = {"seed": task.get("seed")}
            if "options" in task:
                reset["options"] = task["options"]
            observed, _ = await asyncio.to_thread(environment.reset, **reset)
            messages = [{"role": "system", "content": system}] if system else []
            messages.append({"role": "user", "content": observation(observed)})
            llm = episode.async_openai()
            total = 0.0
            for _ in range(max_turns):
                reply = await llm.chat.completions.create(model=model, messages=messages, **sampling)
                text = reply.choices[0].message.content or ""
                observed, reward, terminated, truncated, _ = await asyncio.to_thread(environment.step, action(text))
                total += float(reward)
                if terminated or truncated:
                    break
                messages.append({"role": "assistant", "content": text})
                messages.append({"role": "user", "content": observation(observed)})
            return total
        finally:
            environment.close()

    play.__name__ = name
    agent: SwarmAgent = swarm_agent(tasks=tasks, eval_tasks=eval_tasks, name=name, tag=tag)(play)
    agent.home_dir = Path(sys._getframe(1).f_code.co_filename).resolve().parent  # task files beside the caller
    return agent
