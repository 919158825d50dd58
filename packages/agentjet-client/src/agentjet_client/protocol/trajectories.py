"""AgentJet's trajectories: turns, episodes and the batches a client pushes."""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from agentjet_client.protocol.base import INT64_MAX, _all_log_probabilities, _log_probabilities, _Strict, _whole_numbers
from agentjet_client.protocol.chat import MAX_MESSAGES, MAX_SEQUENCE_TOKENS
from agentjet_client.protocol.responses import FinishReason

# ---------------------------------------------------------------------------------------------
# AgentJet: trajectories
# ---------------------------------------------------------------------------------------------

# strict: a token id sent as a string ("5") or a float is refused, not coerced
TokenId = Annotated[int, Field(strict=True, ge=0, le=INT64_MAX)]
Version = Annotated[int, Field(strict=True, ge=0, le=INT64_MAX)]
MAX_TURNS = 512
MAX_BATCH_TRAJECTORIES = 1024


AGENT_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


def check_agent_name(name: str) -> str:
    """An agent name as it appears in turns and in the capture proxy's URL path."""
    if not isinstance(name, str) or not AGENT_NAME.match(name):
        raise ValueError(
            f"agent name {name!r} must be 1-128 letters, digits, '_', '.' or '-' (it is part of a URL path)"
        )
    return name


class Turn(_Strict):
    """One sampled completion: the exact tokens the policy saw and produced."""

    agent: str = Field(default="default", min_length=1, max_length=128)
    model: str | None = Field(default=None, max_length=256, description="the model the server served")
    requested_model: str | None = Field(
        default=None, max_length=256, description="the model name the agent's code asked for, when it differs"
    )
    policy_version: Version
    request_messages: list[dict[str, Any]] = Field(default_factory=list, max_length=MAX_MESSAGES)
    prompt_token_ids: list[TokenId] = Field(min_length=1, max_length=MAX_SEQUENCE_TOKENS)
    completion_token_ids: list[TokenId] = Field(min_length=1, max_length=MAX_SEQUENCE_TOKENS)
    completion_logprobs: list[float] = Field(max_length=MAX_SEQUENCE_TOKENS)
    completion_versions: list[Version] | None = Field(default=None, max_length=MAX_SEQUENCE_TOKENS)
    finish_reason: FinishReason
    signature: str | None = Field(
        default=None,
        max_length=128,
        pattern=r"^[0-9a-f]+$",
        description="the choice's agentjet.signature, as returned: the server checks the turn is what it sampled",
    )
    reward: float | None = None
    max_tokens: int | None = Field(
        default=None,
        ge=1,
        description="the choice's agentjet.max_tokens: the token limit the server sampled it under (overlong "
        "reward shaping reads it)",
    )
    started_at: float | None = None
    latency_s: float | None = Field(default=None, ge=0.0)
    sampled_from: Literal["processed"] | None = Field(
        default=None,
        description="the choice's agentjet.sampled_from: 'processed' when the request's sampling settings changed "
        "the model's distribution; completion_logprobs are then that distribution's (the behaviour policy)",
    )
    adapter: str | None = Field(
        default=None,
        max_length=128,
        description="the choice's agentjet.adapter: the adapter that sampled it on a server with an adapter per "
        "agent; its policy versions count that adapter's updates",
    )

    @field_validator("prompt_token_ids", "completion_token_ids", mode="before")
    @classmethod
    def _check_ids(cls, value: Any) -> Any:
        return _whole_numbers(value, "token ids")

    @field_validator("completion_versions", mode="before")
    @classmethod
    def _check_versions(cls, value: Any) -> Any:
        return _whole_numbers(value, "policy versions")

    @field_validator("completion_logprobs", mode="before")
    @classmethod
    def _check_logprobs(cls, value: Any) -> Any:
        return _log_probabilities(value)

    @model_validator(mode="after")
    def _check_lengths(self) -> Turn:
        n = len(self.completion_token_ids)
        if len(self.completion_logprobs) != n:
            raise ValueError(
                f"completion_logprobs has {len(self.completion_logprobs)} entries but "
                f"completion_token_ids has {n}; send one log-probability per completion token"
            )
        if self.completion_versions is not None and len(self.completion_versions) != n:
            raise ValueError("completion_versions must have one entry per completion token")
        if not _all_log_probabilities(self.completion_logprobs):
            raise ValueError("completion_logprobs must be finite log-probabilities (<= 0)")
        if self.reward is not None and not math.isfinite(self.reward):
            raise ValueError("turn reward must be a finite number")
        return self

    @property
    def oldest_version(self) -> int:
        if self.completion_versions:
            return min(self.completion_versions)
        return self.policy_version


TrajectoryStatus = Literal["complete", "truncated", "failed"]


class Trajectory(_Strict):
    """What a client pushes for one finished episode.

    ``id`` is the idempotency key (a resend is reported as duplicate), ``task_id`` the GRPO
    group key, ``task_tag`` names the task family in a multi-task mix.
    """

    id: str = Field(min_length=1, max_length=128)
    task_id: str = Field(min_length=1, max_length=256)
    task_tag: str | None = Field(default=None, max_length=128)
    client_id: str | None = Field(default=None, max_length=128)
    code_version: str | None = Field(default=None, max_length=128)
    status: TrajectoryStatus = "complete"
    turns: list[Turn] = Field(default_factory=list, max_length=MAX_TURNS)
    reward: float = 0.0
    agent_rewards: dict[str, float] | None = None
    error: str | None = Field(default=None, max_length=4000)
    # the W3C traceparent of the episode's span (OpenTelemetry), when the client traces: the server's
    # ingest and learner-step spans join the episode's trace
    traceparent: str | None = Field(default=None, max_length=128)
    metadata: dict[str, Any] = Field(default_factory=dict)
    purpose: Literal["train", "eval"] = Field(
        default="train",
        description="eval: an evaluation episode; the server records its reward by policy version, never trains it",
    )

    @model_validator(mode="after")
    def _check(self) -> Trajectory:
        if not math.isfinite(self.reward):
            raise ValueError("reward must be a finite number (got NaN or infinity)")
        if self.status == "complete" and not self.turns:
            raise ValueError(
                "a complete trajectory needs at least one turn; mark an episode that made no "
                "LLM call as status='failed'"
            )
        for name, value in (self.agent_rewards or {}).items():
            if not math.isfinite(value):
                raise ValueError(f"agent_rewards['{name}'] must be a finite number")
        return self

    @property
    def oldest_version(self) -> int | None:
        if not self.turns:
            return None
        return min(turn.oldest_version for turn in self.turns)


class ClientReport(_Strict):
    """What a client run says about itself with each push (``/v1/admin/clients``, ``/metrics``)."""

    id: str = Field(min_length=1, max_length=128)
    spool_depth: int = Field(default=0, ge=0, description="finished trajectories waiting in its spool")
    episodes: int = Field(default=0, ge=0, description="episodes the run has finished")
    running: int = Field(default=0, ge=0, description="episodes in progress")
    code_version: str | None = Field(default=None, max_length=128)


class TrajectoryBatch(_Strict):
    """``POST /v1/trajectories``."""

    trajectories: list[Trajectory] = Field(min_length=1, max_length=MAX_BATCH_TRAJECTORIES)
    client: ClientReport | None = None


SubmitStatus = Literal["accepted", "duplicate", "rejected"]


class TrajectoryResult(_Strict):
    id: str
    status: SubmitStatus
    reason: str | None = None


class TrajectoryBatchResult(_Strict):
    results: list[TrajectoryResult]
    policy_version: int
