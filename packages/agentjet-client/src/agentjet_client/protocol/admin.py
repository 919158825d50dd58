"""AgentJet's admin API (admin keys only, when keys are set)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from agentjet_client.protocol.base import _Strict

# ---------------------------------------------------------------------------------------------
# AgentJet: the admin API (admin keys only, when keys are set)
# ---------------------------------------------------------------------------------------------


class ConfigChange(_Strict):
    """One change made through ``PATCH /v1/admin/config`` (or pause / resume), as logged."""

    at: float = Field(description="unix time of the change")
    step: int = Field(description="the learner step it was made after; it applies from the next one")
    changes: dict[str, Any]
    previous: dict[str, Any] = Field(default_factory=dict)


class AdminConfig(_Strict):
    """``GET`` / ``PATCH /v1/admin/config``: the effective configuration (keys redacted), the
    settings a running server can change, and every change made so far."""

    config: dict[str, Any]
    live: list[str]
    changes: list[ConfigChange] = Field(default_factory=list)
    paused: bool = False


class AdminState(_Strict):
    """The answer to ``POST /v1/admin/pause``, ``/resume`` and ``/stop``."""

    paused: bool
    step: int
    policy_version: int
    message: str


class CheckpointInfo(_Strict):
    """``POST /v1/admin/checkpoint``: the checkpoint written (``--resume`` continues from it)."""

    step: int
    policy_version: int
    path: str
    seconds: float


class AdoptInfo(_Strict):
    """``POST /v1/admin/adopt``: another run's checkpoint taken (population-based training's exploit):
    its weights and optimizer state, served from ``policy_version`` on; this run's settings and step
    count are kept."""

    source: str = Field(description="the checkpoint taken (a step-* directory)")
    source_step: int = Field(description="the learner step the source run had reached")
    step: int
    policy_version: int
    checkpoint: str | None = Field(default=None, description="this run's checkpoint written right after")
    seconds: float


class ClientInfo(_Strict):
    """One client run, as its pushes described it (``GET /v1/admin/clients``)."""

    id: str
    last_seen: float = Field(description="unix time of its last push")
    pushes: int = 0
    trajectories: int = 0  # pushed, any answer
    accepted: int = 0
    duplicate: int = 0
    rejected: int = 0
    evaluated: int = 0
    episodes: int = 0  # as the client reported: finished by the run
    running: int = 0
    spool_depth: int = 0
    code_version: str | None = None


class ClientList(_Strict):
    clients: list[ClientInfo]


class Health(_Strict):
    status: Literal["ok"] = "ok"
    policy_version: int
