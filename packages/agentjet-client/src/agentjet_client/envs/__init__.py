"""Environments people already have, run unchanged as AgentJet agents: ``gym`` (a gymnasium text
environment), ``openenv`` (an OpenEnv environment over HTTP) and ``verifiers`` (a verifiers environment
module), with the model's calls captured token-exact like any agent's. ``env_agent`` is the agent of
``agentjet-client run --env KIND:WHERE [--env-args JSON]``."""

from __future__ import annotations

from typing import Any

from agentjet_client.tasks.agent import SwarmAgent

DEFAULT_SEEDS = 100


def env_agent(spec: str, env_args: dict[str, Any] | None = None) -> SwarmAgent:
    """The agent of ``--env``: ``gymnasium:ENV_ID`` (``gymnasium:module:ENV_ID`` imports the module that
    registers it first) or ``openenv:URL``, whose tasks are seeds 0-99 unless ``--tasks`` gives others; or
    ``verifiers:MODULE`` (``load_environment(**env_args)``), whose tasks are its dataset's rows."""
    kind, _, where = spec.partition(":")
    if env_args is not None and kind != "verifiers":
        raise ValueError("--env-args go to a verifiers environment's load_environment; --env names another kind")
    if kind == "verifiers" and where:
        from agentjet_client.envs.verifiers import verifiers_agent

        return verifiers_agent(where, env_args=env_args, name=where.replace("-", "_"))
    if kind in ("gymnasium", "gym") and where:
        from agentjet_client.envs.gym import gym_agent

        seeds = [{"id": f"seed-{i}", "seed": i} for i in range(DEFAULT_SEEDS)]
        return gym_agent(where, tasks=seeds, name=where.rsplit(":", 1)[-1])
    if kind == "openenv" and where:
        from agentjet_client.envs.openenv import openenv_agent

        seeds = [{"id": f"seed-{i}", "reset": {"seed": i}} for i in range(DEFAULT_SEEDS)]
        return openenv_agent(where, tasks=seeds, name="openenv")
    raise ValueError(
        f"--env {spec}: give gymnasium:ENV_ID, openenv:URL or verifiers:MODULE "
        "(e.g. --env openenv:http://127.0.0.1:8200)"
    )
