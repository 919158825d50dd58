"""Environments people already have, run unchanged as AgentJet agents: ``gym`` (a gymnasium text
environment) and ``openenv`` (an OpenEnv environment over HTTP), with the model's calls captured
token-exact like any agent's. ``env_track`` is ``agentjet-client run --env KIND:WHERE``."""

from __future__ import annotations

from agentjet_client.agent import SwarmAgent
from agentjet_client.tracks import Track

DEFAULT_SEEDS = 100


def env_agent(spec: str) -> SwarmAgent:
    """The agent of ``--env``: ``gymnasium:ENV_ID`` (``gymnasium:module:ENV_ID`` imports the module that
    registers it first) or ``openenv:URL``; its tasks are seeds 0-99 unless ``--tasks`` gives others."""
    kind, _, where = spec.partition(":")
    if kind in ("gymnasium", "gym") and where:
        from agentjet_client.envs.gym import gym_agent

        seeds = [{"id": f"seed-{i}", "seed": i} for i in range(DEFAULT_SEEDS)]
        return gym_agent(where, tasks=seeds, name=where.rsplit(":", 1)[-1])
    if kind == "openenv" and where:
        from agentjet_client.envs.openenv import openenv_agent

        seeds = [{"id": f"seed-{i}", "reset": {"seed": i}} for i in range(DEFAULT_SEEDS)]
        return openenv_agent(where, tasks=seeds, name="openenv")
    raise ValueError(f"--env {spec}: give gymnasium:ENV_ID or openenv:URL (e.g. --env openenv:http://127.0.0.1:8200)")


def env_track(spec: str) -> Track:
    """``run --env``'s code dir: an environment's agent, played in this process."""
    return Track(env_agent(spec), code_version=f"env:{spec}"[:64])
