"""A verifiers environment (Prime Intellect's ``verifiers``, as the Environments Hub packages them: a module
with ``load_environment(...)``) played against the swarm: its dataset, its own rollout (single-turn or its
multi-turn protocol) and its rubric, unchanged; each model call goes through the episode's OpenAI client and
is captured token-exact like any agent's.

    from agentjet_client.envs.verifiers import verifiers_agent

    agent = verifiers_agent("my_env", env_args={"difficulty": 2}, max_tokens=64)

``env`` is a module name (imported with the caller's directory and the working directory on the path, as
``verifiers.load_environment`` does: ``my-env`` -> ``my_env``) or an environment already built. The tasks
are the environment's dataset rows (``example-N`` by their ``example_id``), the evaluation tasks its eval
dataset (unless ``tasks``/``eval_tasks`` say otherwise). The reward is the rubric's weighted sum; each
reward function's score is a reward component (plotted per component). A rollout that ends in an error, or
a reward function that raises (verifiers logs it and scores 0), fails the episode with the error instead
of training a 0. Needs ``pip install 'agentjet-client[verifiers]'`` (verifiers 0.3, whose classic
``Environment`` API ``load_environment`` returns).
"""

from __future__ import annotations

import contextvars
import logging
import sys
from pathlib import Path
from typing import Any

from agentjet_client.errors import extra_hint
from agentjet_client.tasks.agent import SwarmAgent, swarm_agent
from agentjet_client.tasks.rewards import Scored
from agentjet_client.tasks.sources import EvalSource, TaskSource

# the errors verifiers logs while one episode's rollout runs (its reward functions' included)
_LOGGED: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("agentjet_verifiers_logged", default=None)


class VerifiersRolloutError(RuntimeError):
    """A verifiers rollout ended in an error, or one of its reward functions raised."""


class _Collect(logging.Handler):
    """Puts each error verifiers logs into the list of the episode whose rollout logged it."""

    def emit(self, record: logging.LogRecord) -> None:
        errors = _LOGGED.get()
        if errors is not None:
            errors.append(record.getMessage())


_HANDLER = _Collect(logging.ERROR)


def load(env: str, env_args: dict[str, Any] | None, where: list[Path]) -> Any:
    """``verifiers.load_environment(env, **env_args)`` with ``where`` on the import path."""
    try:
        import verifiers as vf
    except ImportError as exc:
        raise ImportError(extra_hint("verifiers environments", "verifiers", exc)) from exc
    for folder in reversed(where):
        if str(folder) not in sys.path:
            sys.path.insert(0, str(folder))
    return vf.load_environment(env, **(env_args or {}))


def dataset_tasks(dataset: Any) -> list[dict[str, Any]]:
    """A verifiers dataset's rows as tasks: each row as it is, with the id ``example-<example_id>``."""
    return (
        []
        if dataset is None
        else [{"id": f"example-{row.get('example_id', index)}", **row} for index, row in enumerate(dataset)]
    )


def _client(environment: Any, episode: Any) -> Any:
    from verifiers.clients import OpenAIChatCompletionsClient, OpenAICompletionsClient

    kind = OpenAICompletionsClient if getattr(environment, "message_type", "chat") == "completion" else None
    return (kind or OpenAIChatCompletionsClient)(episode.async_openai())


def _reward_names(environment: Any) -> set[str]:
    rubric = environment.rubric
    names, weights = rubric._get_reward_func_names(), rubric._get_reward_weights()
    return {name for name, weight in zip(names, weights, strict=False) if weight}


def verifiers_agent(
    env: str | Any,
    *,
    env_args: dict[str, Any] | None = None,
    tasks: TaskSource | None = None,
    eval_tasks: EvalSource | None = None,
    name: str | None = None,
    tag: str | None = None,
    model: str = "agentjet-tiny",
    **sampling: Any,
) -> SwarmAgent:
    """The agent that plays the verifiers environment ``env`` (see the module docstring); ``sampling`` (for
    example ``max_tokens``, ``temperature``) goes to each model call as verifiers' sampling arguments."""
    home = Path(sys._getframe(1).f_code.co_filename).resolve().parent
    environment = load(env, env_args, [home, Path.cwd()]) if isinstance(env, str) else env
    if environment.rubric.has_group_rewards:
        raise ValueError(
            f"the verifiers environment {env!r} scores whole groups (group reward functions); AgentJet plays "
            "each episode on its own: give it per-rollout reward functions, or score the group with a GroupJudge"
        )
    rewards = _reward_names(environment)
    label = name or (env if isinstance(env, str) else type(environment).__name__)
    logging.getLogger("verifiers").addHandler(_HANDLER)

    async def play(task: dict[str, Any], episode: Any) -> Scored:
        row = {key: value for key, value in task.items() if key != "id"}
        errors: list[str] = []
        mark = _LOGGED.set(errors)
        try:
            output = await environment.run_rollout(row, _client(environment, episode), model, dict(sampling))
        finally:
            _LOGGED.reset(mark)
        failure = output.get("error")
        if failure or errors:
            said = (failure or {}).get("error_chain_repr") or (failure or {}).get("message") or "; ".join(errors)
            raise VerifiersRolloutError(f"the verifiers rollout failed: {said}")
        metrics = output.get("metrics") or {}
        return Scored(float(output["reward"]), {key: float(value) for key, value in metrics.items() if key in rewards})

    play.__name__ = label
    if tasks is None:
        tasks = dataset_tasks(environment.build_dataset())
        if not tasks:
            raise ValueError(f"the verifiers environment {label!r} has no dataset: give tasks=... (or run --tasks)")
    if eval_tasks is None:
        eval_tasks = dataset_tasks(environment.build_eval_dataset()) or None
    agent: SwarmAgent = swarm_agent(
        tasks=tasks,
        eval_tasks=eval_tasks,
        name=label,
        tag=tag,
    )(play)
    agent.home_dir = home  # task files beside the caller
    return agent
