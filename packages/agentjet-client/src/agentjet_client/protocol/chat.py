"""OpenAI Chat Completions and Completions requests: parsed strictly, bounded before any expensive work."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from agentjet_client.protocol.base import INT64_MAX, INT64_MIN, _Open, _Strict, _whole_numbers

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
