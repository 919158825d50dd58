"""OpenAI Chat Completions and Completions responses, models and errors: extra fields allowed, so that a
newer server never breaks an older client."""

from __future__ import annotations

from typing import Generic, Literal, TypeVar

from pydantic import Field

from agentjet_client.protocol.base import _Open
from agentjet_client.protocol.chat import ToolCall

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
    # the completion's token limit as the server applied it (the request's max_tokens, or less where the context
    # had less room): a completion of that many tokens was cut off; copy it into the Turn (not signed: it only
    # shapes a reward the client reports itself)
    max_tokens: int | None = None


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
