"""An OpenEnv environment served over HTTP, played by the model: ``reset``/``step``/``state`` over the
environment's WebSocket session (OpenEnv's own ``GenericEnvClient``), the episode's actions from the
model, the environment's rewards.

    from agentjet_client.envs.openenv import openenv_agent

    agent = openenv_agent("http://127.0.0.1:8200", tasks=[{"id": "t1", "reset": {"seed": 1}}], max_turns=4)

One episode opens its own session (an OpenEnv server keeps one environment per session: run it with
``max_concurrent_envs`` at least the runner's ``--concurrency``), resets it with ``task["reset"]`` and
plays turns: the conversation so far -> the model's reply -> ``step(action(reply))``, until the
environment says ``done`` or ``max_turns``. ``observation`` turns an observation (a dict) into message
text (default: its one text field, else its fields as JSON, without ``done``/``reward``/``metadata``);
``action`` turns a reply into the action dict (default ``{"message": reply}``). The reward is the sum of
the step rewards. Needs ``pip install 'agentjet-client[openenv]'`` (``openenv-core``).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentjet_client.errors import extra_hint
from agentjet_client.tasks.agent import SwarmAgent, swarm_agent
from agentjet_client.tasks.sources import EvalSource, TaskSource

_META = {"done", "reward", "metadata"}


def observation_text(observed: dict[str, Any]) -> str:
    """An observation's text: its one string field, else its fields (bar done/reward/metadata) as JSON."""
    fields = {k: v for k, v in observed.items() if k not in _META}
    texts = [v for v in fields.values() if isinstance(v, str)]
    return texts[0] if len(texts) == 1 else json.dumps(fields, ensure_ascii=False, sort_keys=True)


def openenv_agent(
    url: str,
    *,
    tasks: TaskSource,
    eval_tasks: EvalSource | None = None,
    name: str = "openenv",
    tag: str | None = None,
    system: str | None = None,
    max_turns: int = 8,
    observation: Callable[[dict[str, Any]], str] = observation_text,
    action: Callable[[str], dict[str, Any]] = lambda text: {"message": text},
    model: str = "agentjet-tiny",
    **sampling: Any,
) -> SwarmAgent:
    """The agent that plays the OpenEnv environment at ``url`` (see the module docstring); ``sampling`` goes
    to each chat completion."""
    if max_turns < 1:
        raise ValueError("max_turns must be at least 1")
    try:
        from openenv.core.generic_client import GenericEnvClient
    except ImportError as exc:
        raise ImportError(extra_hint("openenv_agent", "openenv", exc)) from exc

    async def play(task: dict[str, Any], episode: Any) -> float:
        async with GenericEnvClient(base_url=url) as env:
            result = await env.reset(**task.get("reset", {}))
            messages = [{"role": "system", "content": system}] if system else []
            messages.append({"role": "user", "content": observation(result.observation)})
            llm = episode.async_openai()
            total = 0.0
            for _ in range(max_turns):
                reply = await llm.chat.completions.create(model=model, messages=messages, **sampling)
                text = reply.choices[0].message.content or ""
                result = await env.step(action(text))
                total += float(result.reward or 0.0)
                if result.done:
                    break
                messages.append({"role": "assistant", "content": text})
                messages.append({"role": "user", "content": observation(result.observation)})
            return total

    play.__name__ = name
    agent: SwarmAgent = swarm_agent(tasks=tasks, eval_tasks=eval_tasks, name=name, tag=tag)(play)
    agent.home_dir = Path(sys._getframe(1).f_code.co_filename).resolve().parent  # task files beside the caller
    return agent
