"""The gateway's own API (``agentjet-client gateway``): feedback and status."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, model_validator

from agentjet_client.protocol.base import _Strict

# ---------------------------------------------------------------------- the gateway (``agentjet-client gateway``)

GatewayOutcome = Literal["trained", "expired", "opted_out", "fallback"]


class Feedback(_Strict):
    """``POST /v1/feedback`` on a gateway: the reward of a live session, which ends it and trains it.

    Give ``reward`` or a ``label`` the gateway maps to one (``--label up=1``); optionally each agent's
    reward, rewards of single calls (by their index in the session, 0 first), and with ``--fan-out`` one
    reward per candidate of the first call (index 0 is the answer the user got)."""

    session: str = Field(min_length=1, max_length=256, description="the session's key or its gateway id")
    reward: float | None = None
    label: str | None = Field(default=None, max_length=64)
    agent_rewards: dict[str, float] | None = None
    turn_rewards: dict[int, float] | None = Field(default=None, description="call index in the session -> reward")
    candidate_rewards: list[float] | None = Field(default=None, max_length=64)

    @model_validator(mode="after")
    def _check(self) -> Feedback:
        if (self.reward is None) == (self.label is None):
            raise ValueError('give the session\'s reward as "reward" (a number) or as a "label", not both')
        numbers = [
            *([self.reward] if self.reward is not None else []),
            *(self.agent_rewards or {}).values(),
            *(self.turn_rewards or {}).values(),
            *(self.candidate_rewards or []),
        ]
        if not all(math.isfinite(x) for x in numbers):
            raise ValueError("rewards must be finite numbers (got NaN or infinity)")
        return self


class FeedbackResult(_Strict):
    """What a gateway did with a session's feedback (the same answer again for a repeated feedback)."""

    session: str = Field(description="the session's gateway id")
    outcome: GatewayOutcome
    reward: float | None = None
    trajectories: list[str] = Field(default_factory=list, description="the ids pushed for it")
    repeated: bool = Field(default=False, description="this session had ended already with this feedback")


class GatewayCounts(_Strict):
    """A gateway's sessions since its spool dir was new: ``sessions`` = ``trained`` + ``expired`` +
    ``opted_out`` + ``fallback`` + ``open`` + ``waiting`` (sessions ended and waiting for their reward)."""

    sessions: int = 0
    calls: int = 0
    trained: int = 0
    judged: int = Field(default=0, description="of those trained, the sessions a judge rewarded (--judge-url)")
    expired: int = 0
    opted_out: int = 0
    fallback: int = 0
    candidates_dropped: int = 0
    untrained_calls: int = Field(default=0, description="calls forwarded for opted-out sessions (never recorded)")
    open: int = 0
    waiting: int = 0


class GatewayStatus(_Strict):
    """``GET /v1/gateway/status``."""

    gateway_id: str
    servers: dict[str, str] = Field(description="agent -> server URL ('default' for every other agent)")
    counts: GatewayCounts
    spooled: int = Field(description="trajectories in the spools, not yet answered by their servers")
    answers: dict[str, int] = Field(default_factory=dict, description="accepted, duplicate, rejected")
    fan_out: int = 0
    group_size: int | None = Field(default=None, description="the default server's GRPO group size, as last read")
    server_reachable: bool = True
