"""The wire protocol: every type that crosses the network between client and server.

Both packages import these models; nothing else defines a wire type. Routes are versioned
under ``/v1``.

Two families live here:

* OpenAI Chat Completions types. Requests are parsed strictly (an unknown or misspelt field
  is a 400 that names it), responses allow extra fields so that a newer server never breaks
  an older client. OpenAI fields come first in the spec's order; our extension sits in one
  marked block at the end of each model.
* AgentJet's own types (trajectories, status). They forbid unknown fields.
"""

from __future__ import annotations

import json
import math
import re
from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# ---------------------------------------------------------------------------------------------
# OpenAI Chat Completions: requests
# ---------------------------------------------------------------------------------------------


# Bounds on what a request may hold, checked before any expensive work (a list longer than its bound
# is refused at its first surplus item, so a huge list can't produce a huge error report)
MAX_MESSAGES = 4096
MAX_CONTENT_PARTS = 1024
MAX_TOOLS = 128
MAX_TOOL_CALLS = 128
MAX_STOP_CHARS = 1024
MAX_SEQUENCE_TOKENS = 1 << 20  # token ids in one list: far beyond any model's context
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


def _all_log_probabilities(values: list[Any]) -> bool:
    """Every item a finite number at most 1e-4 (checked by builtins, without a Python-level loop)."""
    return (
        set(map(type, values)) <= {int, float}
        and all(map(math.isfinite, values))
        and (not values or max(values) <= 1e-4)
    )


def _whole_numbers(value: Any, what: str) -> Any:
    """Check a long list of integers in one pass and fail at its first bad item, so a list of a
    million strings is one error, not a million (each would be rendered into the 400)."""
    if isinstance(value, list):
        # the common case checked by builtins (a 2k-token list in microseconds); the loop finds the culprit
        if set(map(type, value)) <= {int} and (not value or (min(value) >= 0 and max(value) <= INT64_MAX)):
            return value
        for i, x in enumerate(value):
            if type(x) is not int or not 0 <= x <= INT64_MAX:
                raise ValueError(
                    f"item {i} is {json.dumps(x, default=str)[:40]}: {what} are JSON integers from 0 to 2^63-1"
                )
    return value


def _log_probabilities(value: Any) -> Any:
    if isinstance(value, list):
        if _all_log_probabilities(value):
            return value
        for i, x in enumerate(value):
            if type(x) not in (int, float) or not math.isfinite(x) or x > 1e-4:
                raise ValueError(
                    f"item {i} is {json.dumps(x, default=str)[:40]}: completion_logprobs must be finite "
                    "log-probabilities (<= 0), one per completion token"
                )
    return value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Open):
    name: str
    arguments: str


class ToolCall(_Open):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Open):
    """One message of a conversation. Content may be a string or a list of text parts."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(default=None, max_length=256)
    tool_calls: list[ToolCall] | None = Field(default=None, max_length=MAX_TOOL_CALLS)
    tool_call_id: str | None = Field(default=None, max_length=256)

    @field_validator("content")
    @classmethod
    def _check_parts(cls, value: str | list[TextPart] | None) -> str | list[TextPart] | None:
        if isinstance(value, list) and len(value) > MAX_CONTENT_PARTS:
            raise ValueError(f"at most {MAX_CONTENT_PARTS} content parts are allowed; join the text into fewer parts")
        return value

    def text(self) -> str:
        """The message's content flattened to one string."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionDefinition(_Open):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Open):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedToolChoiceFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"] = "function"
    function: NamedToolChoiceFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class StreamOptions(_Open):
    include_usage: bool | None = None


class RequestExtension(_Strict):
    """Our extension on a chat request (``agentjet``): the agent making the call (its sample is
    signed for that agent) and the exact tokens of the earlier call this request continues, so the
    server starts from them instead of re-tokenising their text."""

    agent: str | None = Field(default=None, min_length=1, max_length=128, description="the calling agent's name")
    prefix_token_ids: list[Annotated[int, Field(strict=True, ge=0, le=INT64_MAX)]] | None = Field(
        default=None,
        min_length=2,
        max_length=MAX_SEQUENCE_TOKENS,
        description="the earlier call's prompt + completion ids",
    )
    prefix_prompt_tokens: int | None = Field(
        default=None, ge=1, le=MAX_SEQUENCE_TOKENS, description="how many of them were its prompt"
    )

    @field_validator("prefix_token_ids", mode="before")
    @classmethod
    def _check_ids(cls, value: Any) -> Any:
        return _whole_numbers(value, "token ids")

    @model_validator(mode="after")
    def _both_or_neither(self) -> RequestExtension:
        if (self.prefix_token_ids is None) != (self.prefix_prompt_tokens is None):
            raise ValueError("prefix_token_ids and prefix_prompt_tokens go together: send both or neither")
        return self


class SamplingExtras(_Strict):
    """Sampling settings that change the model's distribution (OpenAI's ``logit_bias`` and penalties,
    vLLM's ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``). A token sampled
    with any of them comes from a *processed* distribution: the server records that distribution's
    log-probability as the turn's behaviour log-probability, and the learner corrects for the difference
    from the policy as it does for a stale turn (docs/protocol.md, "Processed sampling")."""

    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(default=None, max_length=300)
    top_k: int | None = Field(default=None, ge=-1, le=1_000_000)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, ge=1e-2, le=100.0)
    min_tokens: int | None = Field(default=None, ge=0)
    ignore_eos: bool | None = None
    # json_object / json_schema: the answer constrained to the grammar (text completions take it as vLLM's do)
    response_format: dict[str, Any] | None = None

    @field_validator("logit_bias")
    @classmethod
    def _check_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.isdigit() or len(key) > 12:
                raise ValueError(f"logit_bias keys are token ids written as text (got {key[:20]!r})")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must lie in [-100, 100] (token {key}: {bias!r})")
        return value

    def processing(self) -> dict[str, Any]:
        """The settings given that change the distribution (an empty dict: the model's own)."""
        out: dict[str, Any] = {}
        if self.frequency_penalty:
            out["frequency_penalty"] = self.frequency_penalty
        if self.presence_penalty:
            out["presence_penalty"] = self.presence_penalty
        if self.logit_bias and any(self.logit_bias.values()):
            out["logit_bias"] = {int(k): v for k, v in self.logit_bias.items() if v}
        if self.top_k is not None and self.top_k > 0:
            out["top_k"] = self.top_k
        if self.min_p:
            out["min_p"] = self.min_p
        if self.repetition_penalty is not None and self.repetition_penalty != 1.0:
            out["repetition_penalty"] = self.repetition_penalty
        if self.min_tokens:
            out["min_tokens"] = self.min_tokens
        if self.ignore_eos:
            out["ignore_eos"] = True
        return out


def _check_format(response_format: dict[str, Any] | None) -> None:
    if response_format and response_format.get("type") not in (None, "text", "json_object", "json_schema"):
        raise ValueError("response_format type must be text, json_object or json_schema")


def _stops(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


class ChatCompletionRequest(SamplingExtras):
    """``POST /v1/chat/completions``. Unknown fields are rejected so a typo is never ignored."""

    model: str | None = Field(default=None, max_length=256)
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    metadata: dict[str, str] | None = None
    n: int = Field(default=1, ge=1, le=64)
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    service_tier: str | None = None
    stop: str | list[str] | None = None
    store: bool | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    tool_choice: ToolChoice | None = None
    tools: list[ToolDefinition] | None = Field(default=None, max_length=MAX_TOOLS)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    user: str | None = None
    # --- AgentJet extension ---
    agentjet: RequestExtension | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > 4:
            raise ValueError("at most 4 stop sequences are allowed; pass fewer")
        if value == "" or (isinstance(value, list) and "" in value):
            raise ValueError("stop sequences must be non-empty strings")
        if any(len(x) > MAX_STOP_CHARS for x in ([value] if isinstance(value, str) else value or [])):
            raise ValueError(f"a stop sequence may have at most {MAX_STOP_CHARS} characters")
        return value

    @model_validator(mode="after")
    def _check_unsupported(self) -> ChatCompletionRequest:
        _check_format(self.response_format)
        if isinstance(self.tool_choice, NamedToolChoice):
            names = {tool.function.name for tool in self.tools or []}
            if self.tool_choice.function.name not in names:
                raise ValueError(f"tool_choice names '{self.tool_choice.function.name}', which is not in tools")
        return self

    @property
    def stop_list(self) -> list[str]:
        return _stops(self.stop)

    def completion_limit(self, default: int) -> int:
        """The completion token budget: ``max_completion_tokens`` wins over ``max_tokens``."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        if self.max_tokens is not None:
            return self.max_tokens
        return default


MAX_PROMPTS = 64  # prompts in one text-completion request


class CompletionRequest(SamplingExtras):
    """``POST /v1/completions``: text completions (no chat template), as vLLM's server serves them.
    ``prompt`` is text, token ids, or a list of either (one answer per prompt, ``n`` each)."""

    model: str | None = Field(default=None, max_length=256)
    prompt: (
        str
        | list[str]
        | list[Annotated[int, Field(strict=True, ge=0)]]
        | list[list[Annotated[int, Field(strict=True, ge=0)]]]
    )
    max_tokens: int | None = Field(default=16, ge=0)  # 0 only with echo: the prompt scored, nothing sampled
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=64)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = Field(default=None, ge=0, le=20)
    # the prompt comes back before the completion; with logprobs, each prompt token's log-probability too (the
    # first's is null): a text scored by the model, as a distillation teacher's log-probs
    echo: bool | None = False
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    suffix: str | None = None
    best_of: int | None = None
    user: str | None = None
    # --- AgentJet extension (the agent making the call) ---
    agentjet: RequestExtension | None = None

    _check_stop = field_validator("stop")(ChatCompletionRequest._check_stop.__func__)  # type: ignore[attr-defined]

    @model_validator(mode="after")
    def _check_unsupported(self) -> CompletionRequest:
        if self.echo and self.stream:
            raise ValueError("echo is answered whole only: send stream false to score a prompt")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 samples nothing: it is for scoring a prompt with echo true (and logprobs)")
        if self.suffix:
            raise ValueError("suffix (fill-in-the-middle) is not supported; leave it out")
        if self.best_of not in (None, 1):
            raise ValueError("best_of is not supported: every sample is returned (use n)")
        _check_format(self.response_format)
        if self.agentjet is not None and self.agentjet.prefix_token_ids is not None:
            raise ValueError("agentjet.prefix_token_ids is for chat requests; send the prompt's token ids as 'prompt'")
        if isinstance(self.prompt, list) and (not self.prompt or len(self.prompts) > MAX_PROMPTS):
            # a list of token ids is one prompt; a list of texts or of token-id lists is several
            raise ValueError(f"prompt must hold 1 to {MAX_PROMPTS} prompts (or be text)")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """Each prompt: text or token ids."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if all(isinstance(p, int) for p in self.prompt):
            return [list(self.prompt)]  # type: ignore[arg-type]
        return list(self.prompt)  # type: ignore[arg-type]

    @property
    def stop_list(self) -> list[str]:
        return _stops(self.stop)


# ---------------------------------------------------------------------------------------------
# OpenAI Chat Completions: responses
# ---------------------------------------------------------------------------------------------

FinishReason = Literal["stop", "length", "tool_calls"]


class TopLogprob(_Open):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(_Open):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(_Open):
    content: list[TokenLogprob] | None = None


class AssistantMessage(_Open):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None
    # what the model thought before answering, read by the server's reasoning parser (vLLM's
    # current name and its earlier one, which most clients read)
    reasoning: str | None = None
    reasoning_content: str | None = None


class AgentJetExtension(_Open):
    """Our extension on each choice: exactly what was sampled, by which policy version.

    ``completion_versions[i]`` is the policy version whose weights produced token ``i``;
    ``policy_version`` is the oldest of them (what staleness is measured from).
    """

    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    completion_logprobs: list[float]
    completion_versions: list[int]
    finish_reason: FinishReason
    policy_version: int
    # how the prompt used ``agentjet.prefix_token_ids`` of the request, if it had them
    prefix: Literal["extended", "spliced", "mismatch", "reasoning_dropped"] | None = None
    prefix_drift: bool = False  # re-tokenising the history would have changed the prefix's tokens
    # the server's HMAC over prompt ids, completion ids, logprobs and versions: copy it into the Turn
    signature: str | None = None
    # "processed": sampled from the model's distribution as the request's settings changed it (logit_bias,
    # penalties, ...); completion_logprobs are then that distribution's: copy it into the Turn
    sampled_from: Literal["processed"] | None = None
    # the LoRA adapter that sampled it (a server with an adapter per agent): its versions are that adapter's
    # own count; copy it into the Turn
    adapter: str | None = None


class Choice(_Open):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason
    # --- AgentJet extension ---
    agentjet: AgentJetExtension | None = None


class Usage(_Open):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


ChoiceT = TypeVar("ChoiceT", bound=_Open)


class _Completion(_Open, Generic[ChoiceT]):
    """What a completion answer (or stream chunk) wraps its choices in; each kind fixes ``object``."""

    id: str
    object: str
    created: int
    model: str
    choices: list[ChoiceT]
    usage: Usage | None = None


class ChatCompletion(_Completion[Choice]):
    object: Literal["chat.completion"] = "chat.completion"


class ToolCallDelta(_Open):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: dict[str, str] | None = None


class ChoiceDelta(_Open):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(_Open):
    index: int
    delta: ChoiceDelta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None
    # --- AgentJet extension (only on the chunk that carries finish_reason) ---
    agentjet: AgentJetExtension | None = None


class ChatCompletionChunk(_Completion[ChunkChoice]):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"


class CompletionLogprobs(_Open):
    """The legacy log-probability shape of text completions."""

    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token (nothing predicts it)
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class CompletionChoice(_Open):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    # --- AgentJet extension (whole answers, and the stream chunk that carries finish_reason) ---
    agentjet: AgentJetExtension | None = None


class TextCompletion(_Completion[CompletionChoice]):
    object: Literal["text_completion"] = "text_completion"


class ModelCard(_Open):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "agentjet"


class ModelList(_Open):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(_Open):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


# the error type of the 503 a server answers while it starts (builds or loads its model), and the
# seconds its Retry-After asks a client to wait
STARTING = "server_starting"
STARTING_RETRY_S = 5


class ErrorResponse(_Open):
    """OpenAI's error shape; every non-2xx answer of the server has this body."""

    error: ErrorDetail

    @classmethod
    def message_of(cls, body: str) -> str:
        """The message of an error answer in this shape, or the body's start when it is not one
        (a proxy's HTML page, say): what clients show for a non-2xx answer."""
        try:
            return cls.model_validate_json(body).error.message
        except ValueError:  # pydantic's ValidationError is a ValueError
            return body[:500]

    @classmethod
    def type_of(cls, body: str) -> str | None:
        """The error type of an answer in this shape (None when it is not one)."""
        try:
            return cls.model_validate_json(body).error.type
        except ValueError:
            return None


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


# ---------------------------------------------------------------------------------------------
# AgentJet: status
# ---------------------------------------------------------------------------------------------


class TrajectoryCounts(_Strict):
    accepted: int = 0  # training episodes (evaluation episodes are counted in `evaluated`)
    duplicate: int = 0
    rejected: int = 0
    rejected_by_reason: dict[str, int] = Field(default_factory=dict)
    buffered: int = 0
    aged_out_groups: int = 0  # incomplete GRPO groups trained smaller after --group-timeout
    trained: int = 0  # taken by the learner, batches without a reward signal included
    evaluated: int = 0  # evaluation episodes recorded (never trained)
    # turns of accepted trajectories since this server process started: signature checked, or none sent
    verified_turns: int = 0
    unsigned_turns: int = 0


class LearnerInfo(_Strict):
    algorithm: str
    step: int
    batch_groups: int
    group_size: int
    max_staleness: int
    last_loss: float | None = None
    last_step_seconds: float | None = None
    last_mean_reward: float | None = None
    skipped_batches: int = 0
    last_error: str | None = None
    last_checkpoint_step: int | None = None  # what --resume would continue from
    # with --checkpoint-uri: the newest checkpoint in the object store, the log bytes not there yet, its last error
    last_uploaded_step: int | None = None
    remote_log_lag_bytes: int = 0
    object_store_error: str | None = None
    off_policy: str | None = None  # decoupled | tis | none
    stale_policy: str | None = None  # drop | downweight: an episode past max_staleness when trained
    stale_at_training: int = 0  # episodes that aged past the bound while they waited, left out
    downweighted_tokens: int = 0  # tokens trained with less weight for the same reason
    # trained tokens by how many versions older than the weights they updated ("0", "1", ...; this process)
    trained_token_lag: dict[str, int] = Field(default_factory=dict)


class ContextCounts(_Strict):
    """Requests that named the earlier call they continue (``agentjet.prefix_token_ids``)."""

    prefix_requests: int = 0
    extended: int = 0  # the prefix text starts the rendered prompt: its tokens used as they were
    spliced: int = 0  # an answer re-rendered differently (e.g. tool-call JSON): the sampled tokens used
    mismatch: int = 0  # the history really differed (edited, retried): rendered afresh
    reasoning_dropped: int = 0  # the template leaves out earlier reasoning: rendered afresh, a new timeline
    drift_prevented: int = 0  # re-tokenising would have given other tokens than the model sampled


class TagInfo(_Strict):
    """One task tag's episodes on a server (``@swarm_agent(tag=...)``), since the server started."""

    accepted: int = 0  # training episodes accepted
    buffered: int = 0  # accepted and waiting to be trained
    trained: int = 0  # taken into a learner step
    mean_reward: float | None = None  # of the trained ones
    mean_lag: float | None = None  # policy versions between sampling and training, per trained episode
    share: float | None = None  # its share of admitted episodes under --mix (None: not in the mix)
    admission_budget: int | None = None  # episodes of this tag a runner may start now (under --mix)

    def summary(self) -> str:
        def figure(value: float | None) -> str:
            return "-" if value is None else f"{value:.3f}"

        share = f"share {self.share:.2f} " if self.share is not None else ""
        budget = f"  budget {self.admission_budget}" if self.admission_budget is not None else ""
        return (
            f"{share}trained {self.trained} of {self.accepted} accepted (buffered {self.buffered})  "
            f"reward {figure(self.mean_reward)}  staleness {figure(self.mean_lag)}{budget}"
        )


class ToolCallInfo(_Strict):
    """One agent's answers to requests with tools, and how many opened a call the server could not read."""

    answers: int = 0
    malformed: int = 0
    by_version: dict[str, list[int]] = Field(
        default_factory=dict, description="policy version -> [answers, malformed] (the newest versions)"
    )


class ReplicaInfo(_Strict):
    """One engine replica of a server started with ``--engine-replicas N``."""

    index: int
    device: str
    state: Literal["starting", "ready", "restarting", "stopped"]
    pid: int | None = None
    version: int | None = None  # the policy version of the weights it serves
    in_flight: int = 0  # requests it is sampling now
    requests: int = 0  # requests routed to it since the server started
    tokens: int = 0  # tokens it sampled
    restarts: int = 0  # times its process died and was started again
    failovers: int = 0  # requests that were in flight when it died and went on on another replica
    sleeps: bool = False  # --engine-sleep: it sleeps through every learner step (it shares the learner's device)
    asleep: bool = False  # asleep now: requests go to an awake replica, or wait for the step to end

    def summary(self) -> str:
        state = f"{self.state}, asleep" if self.asleep else self.state
        return (
            f"replica {self.index} ({self.device}, {state}, v{self.version}): in flight {self.in_flight}  "
            f"requests {self.requests}  tokens {self.tokens}"
            + (f"  restarts {self.restarts}  failed over {self.failovers}" if self.restarts or self.failovers else "")
        )


class TaskRate(_Strict):
    """Per task (``/v1/status`` ``tasks``): accepted training episodes, their mean reward, the share solved
    (reward at least 1), and its finished groups, of which how many had all rewards equal."""

    task: str
    episodes: int = 0
    mean_reward: float = 0.0
    solved: float = 0.0
    groups: int = 0
    tied_groups: int = 0


class ServerStatus(_Strict):
    """``GET /v1/status``: what the server is doing, and how many episodes it wants now."""

    model: str
    policy_version: int
    trajectories: TrajectoryCounts
    learner: LearnerInfo
    admission_budget: int = Field(
        description="Episodes a runner may start now so that they land within the staleness bound"
    )
    uptime_s: float
    context: ContextCounts = Field(default_factory=ContextCounts)
    paused: bool = False  # learning paused by the admin API (serving and ingestion go on)
    by_tag: dict[str, TagInfo] = Field(default_factory=dict, description="per task tag ('' for untagged)")
    replicas: list[ReplicaInfo] = Field(default_factory=list, description="engine replicas (--engine-replicas > 1)")
    run_id: str | None = Field(
        default=None, description="names the server's run: kept by --resume, new after --fresh or a new state dir"
    )
    tool_calls: dict[str, ToolCallInfo] = Field(
        default_factory=dict, description="per agent: answers to requests with tools, and malformed calls among them"
    )
    serve_only: bool = Field(default=False, description="started with --serve-only: serves, never trains")
    tasks: list[TaskRate] = Field(default_factory=list, description="per task, the most recently trained first")
    adapters: dict[str, int] = Field(
        default_factory=dict, description="an adapter per agent (--adapters): each adapter's own policy version"
    )

    def budget_for(self, tag: str | None) -> int:
        """Episodes of task ``tag`` a runner may start now: the tag's own budget under ``--mix``,
        else the server's."""
        info = self.by_tag.get(tag or "")
        if info is not None and info.admission_budget is not None:
            return info.admission_budget
        return self.admission_budget

    def summary(self) -> str:
        """One line for people: what ``agentjet-server status`` and ``agentjet-client status`` print."""
        t = self.trajectories
        reasons = f" {t.rejected_by_reason}" if t.rejected_by_reason else ""
        return (
            f"model {self.model}  policy v{self.policy_version}  step {self.learner.step}  "
            + (f"reward {self.learner.last_mean_reward:.3f}  " if self.learner.last_mean_reward is not None else "")
            + f"accepted {t.accepted}  duplicate {t.duplicate}  rejected {t.rejected}{reasons}  "
            f"buffered {t.buffered}  trained {t.trained}  turns verified {t.verified_turns}"
            + (f" (unsigned {t.unsigned_turns})" if t.unsigned_turns else "")
            + f"  admission budget {self.admission_budget}"
            + ("  LEARNING PAUSED" if self.paused else "")
            + (
                f"  checkpoint step {self.learner.last_checkpoint_step}"
                if self.learner.last_checkpoint_step is not None
                else ""
            )
            + "".join(  # task tags, where there are any (a server of untagged episodes has just '')
                f"\n  tag {tag or '(none)'}: {info.summary()}"
                for tag, info in sorted(self.by_tag.items())
                if set(self.by_tag) != {""}
            )
            + "".join(f"\n  {replica.summary()}" for replica in self.replicas)
        )


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
