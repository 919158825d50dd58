"""A request's way to token ids: chat messages rendered with the model's template (or continued from the
token ids of an earlier call, ``continuation``), text prompts tokenised as vLLM does, and every bound
(context, completion budget, token entries) checked before anything is sampled."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from agentjet_client.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ContextCounts,
    SamplingExtras,
)
from agentjet_server.engine.base import Engine, SamplingParams
from agentjet_server.engine.grammar import grammar_of
from agentjet_server.errors import InvalidRequestError
from agentjet_server.ingest.signing import DEFAULT_AGENT
from agentjet_server.serving.chat_format import forced_tool_prefix
from agentjet_server.serving.continuation import Status, continue_from
from agentjet_server.serving.parsing import ChoiceReader, OutputParser, Parsed

# n x max_tokens x (1 + top_logprobs) a single request may ask for: bounds its memory and response size
MAX_TOKEN_ENTRIES = 1 << 20
FALLBACK_TOKEN_CHARS = 64  # characters per token assumed where the vocabulary lists no token (empty)


@dataclass(frozen=True)
class PreparedRequest:
    prompt_ids: list[int]
    params: SamplingParams
    forced_prefix: str
    tools_active: bool
    want_logprobs: bool
    prefix_status: Status | None = None  # how the request's prefix tokens were used (``continuation``)
    prefix_drift: bool = False
    agent: str = DEFAULT_AGENT  # who asked (``agentjet.agent``): the sample is signed for this agent
    # a model family's parser (``parsing``): a fresh reader per choice; None = the built-in Hermes reading
    reader: Callable[[], ChoiceReader] | None = None


def adapter_for(engine: Engine, model: str | None, agent: str) -> str | None:
    """The adapter a request samples with on a server with an adapter per agent: the one its model names,
    else its agent's; None on a server of one model."""
    names = engine.adapters
    if not names:
        return None
    if model in names:
        return model
    if agent in names:
        return agent
    raise InvalidRequestError(
        f"this server trains an adapter per agent ({', '.join(names)}), and this request names none: its agent is "
        f"{agent!r} and its model {model!r}. Name the adapter as the model, or run the agent under that name "
        "(agentjet.agent; the client's --agent or @swarm_agent(name=...); X-AgentJet-Agent at the gateway)",
        param="model",
        code="adapter_not_found",
    )


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    out = []
    for message in messages:
        item: dict[str, Any] = {"role": message.role, "content": message.text()}
        if message.name:
            item["name"] = message.name
        if message.tool_calls:
            item["tool_calls"] = [call.model_dump() for call in message.tool_calls]
        if message.tool_call_id:
            item["tool_call_id"] = message.tool_call_id
        extra = message.model_extra or {}
        reasoning = extra.get("reasoning_content", extra.get("reasoning"))
        if message.role == "assistant" and isinstance(reasoning, str):
            item["reasoning"] = item["reasoning_content"] = reasoning  # both names templates read
        out.append(item)
    return out


def processing(engine: Engine, request: SamplingExtras, max_tokens: int, exact: bool) -> dict[str, Any]:
    """``SamplingParams``' settings that change the distribution, as ``request`` gives them (none: ``{}``);
    refused with what to do where this server (``exact``: ``--exact-sampling``) or its engine does not
    sample with them."""
    given = request.processing()
    grammar = grammar_of(request.response_format)
    if grammar is not None:
        given["response_format"] = grammar
    if not given:
        return {}
    named, param = ", ".join(sorted(given)), sorted(given)[0]
    if exact:
        raise InvalidRequestError(
            f"{named}: this server samples from the policy itself only (--exact-sampling), and these settings "
            "change its distribution; leave them out",
            param=param,
        )
    unsupported = sorted(set(given) - engine.processed_settings)
    if unsupported:
        raise InvalidRequestError(
            f"{', '.join(unsupported)}: this server's engine does not sample with "
            f"{'this setting' if len(unsupported) == 1 else 'these settings'}; serve with --engine transformers "
            "to use them, or leave them out",
            param=unsupported[0],
        )
    vocab = len(engine.chat.tokenizer)
    bias: dict[int, float] = given.pop("logit_bias", {})
    if any(token >= vocab for token in bias):
        raise InvalidRequestError(
            f"logit_bias names token ids outside the vocabulary (0..{vocab - 1})", param="logit_bias"
        )
    if given.get("min_tokens", 0) > max_tokens:
        raise InvalidRequestError(
            f"min_tokens is {given['min_tokens']}, more than max_tokens ({max_tokens}); lower it",
            param="min_tokens",
        )
    grammar = given.pop("response_format", None)
    if grammar is not None:
        given["grammar"] = grammar
    return {**given, "logit_bias": tuple(sorted(bias.items()))} if bias else given


class PromptBuilder:
    """Prepares chat and text requests for one engine (``prepare_chat``, ``prepare_text``); CPU-bound, so
    the services run it in a worker thread. Counts how prefix continuations went (``context``)."""

    def __init__(
        self,
        engine: Engine,
        *,
        parser: OutputParser | None = None,
        default_max_tokens: int = 512,
        max_token_entries: int = MAX_TOKEN_ENTRIES,
        exact_sampling: bool = False,
    ) -> None:
        self.engine = engine
        self.exact_sampling = exact_sampling
        self.parser = parser or OutputParser()
        self.default_max_tokens = default_max_tokens
        self.max_token_entries = max_token_entries
        self.context = ContextCounts()
        self._counts_lock = threading.Lock()  # requests are prepared in worker threads
        # no token spans more characters than the longest vocabulary entry: text longer than
        # context x that can't fit, and is refused before it is tokenised
        longest = max((len(t) for t in engine.chat.tokenizer.get_vocab()), default=0)
        self.max_prompt_chars = engine.max_context * (longest or FALLBACK_TOKEN_CHARS)

    def _check_size(self, request: ChatCompletionRequest, tools: list[dict[str, Any]] | None) -> None:
        """Refuse, before tokenising, a conversation whose text can't fit in the context."""
        chars = sum(len(m.text()) for m in request.messages)
        if tools:
            chars += sum(len(json.dumps(t, ensure_ascii=False)) for t in tools)
        if chars > self.max_prompt_chars:
            raise InvalidRequestError(
                f"the messages{' and tools' if tools else ''} hold {chars} characters, more than fit in the "
                f"model's context of {self.engine.max_context} tokens (at most {self.max_prompt_chars} characters); "
                "shorten the conversation",
                param="messages",
                code="context_length_exceeded",
            )

    def _prompt(
        self, request: ChatCompletionRequest, tools: list[dict[str, Any]] | None, prefix: str
    ) -> tuple[list[int], Status | None, bool]:
        """The prompt's token ids; with ``agentjet.prefix_token_ids``, continued from those exactly."""
        messages = message_dicts(request.messages)
        chat = self.engine.chat
        claim = request.agentjet
        if claim is None or claim.prefix_token_ids is None:
            return self.engine.render(messages, tools, assistant_prefix=prefix), None, False
        assert claim.prefix_prompt_tokens is not None  # validated: both or neither
        if claim.prefix_prompt_tokens >= len(claim.prefix_token_ids):
            raise InvalidRequestError(
                f"agentjet.prefix_prompt_tokens is {claim.prefix_prompt_tokens} but prefix_token_ids has only "
                f"{len(claim.prefix_token_ids)} tokens; it must count the earlier call's prompt, which is "
                "followed by its completion",
                param="agentjet.prefix_prompt_tokens",
            )
        vocab = len(chat.tokenizer)
        if any(t < 0 or t >= vocab for t in claim.prefix_token_ids):
            raise InvalidRequestError(
                f"agentjet.prefix_token_ids holds ids outside the vocabulary (0..{vocab - 1}); send the ids "
                "this server returned",
                param="agentjet.prefix_token_ids",
            )
        if len(claim.prefix_token_ids) > self.engine.max_context:
            raise InvalidRequestError(
                f"agentjet.prefix_token_ids has {len(claim.prefix_token_ids)} tokens, more than the model's context "
                f"of {self.engine.max_context}; send the ids of an earlier call this server answered",
                param="agentjet.prefix_token_ids",
                code="context_length_exceeded",
            )
        result = continue_from(
            chat,
            claim.prefix_token_ids,
            claim.prefix_prompt_tokens,
            messages,
            tools,
            prefix,
            self._history_reader(tools),
        )
        with self._counts_lock:
            counts = self.context
            counts.prefix_requests += 1
            setattr(counts, result.status, getattr(counts, result.status) + 1)
            counts.drift_prevented += int(result.drift)
        return result.prompt_ids, result.status, result.drift

    def _history_reader(self, tools: list[dict[str, Any]] | None) -> Callable[[list[int]], Parsed]:
        """How an earlier completion (its token ids) reads as an answer, for ``continuation``."""
        chat = self.engine.chat
        parser = self.parser

        def read(completion: list[int]) -> Parsed:
            body = completion[:-1] if completion and completion[-1] in chat.stop_ids else completion
            reader = parser.reader([{"role": "user", "content": ""}], tools, "auto" if tools else None, [])
            if reader is None:
                return parser.answer(chat.decode(body), completion)
            text = chat.decode_all(body) if reader.keep_special_tokens else chat.decode(body)
            return reader.whole(text, completion)

        return read

    def prepare_chat(self, request: ChatCompletionRequest) -> PreparedRequest:
        """Render and tokenise the prompt and fix the sampling budget; every bound is checked here,
        before any token is sampled. CPU-bound: routes run it in a worker thread (the services do)."""
        tools_active = bool(request.tools) and request.tool_choice != "none"
        # a family's parser reads what the model chose to call; only the built-in format is forced
        prefix = forced_tool_prefix(request.tool_choice) if tools_active and self.parser.builtin else ""
        if request.tool_choice not in (None, "none", "auto") and not request.tools:
            raise InvalidRequestError("tool_choice needs a non-empty 'tools' list", param="tool_choice")
        tools = [tool.model_dump(exclude_none=True) for tool in request.tools or []] if tools_active else None
        self._check_size(request, tools)
        prompt_ids, prefix_status, drift = self._prompt(request, tools, prefix)
        room = self.engine.max_context - len(prompt_ids)
        if room <= 0:
            raise InvalidRequestError(
                f"the prompt is {len(prompt_ids)} tokens but the model's context is "
                f"{self.engine.max_context}; shorten the conversation",
                param="messages",
                code="context_length_exceeded",
            )
        asked = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        if asked is not None and asked > room:
            field = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
            raise InvalidRequestError(
                f"{field} is {asked}, but the prompt is {len(prompt_ids)} tokens and the model's context is "
                f"{self.engine.max_context}: at most {room} tokens are left for the completion; lower {field}",
                param=field,
                code="context_length_exceeded",
            )
        limit = min(request.completion_limit(self.default_max_tokens), room)
        entries = request.n * limit * (1 + (request.top_logprobs or 0) if request.logprobs else 1)
        if entries > self.max_token_entries:
            raise InvalidRequestError(
                f"this request could sample n={request.n} x {limit} tokens"
                + (
                    f" with {request.top_logprobs} top log-probs each"
                    if request.logprobs and request.top_logprobs
                    else ""
                )
                + f" ({entries} token entries); the server answers at most {self.max_token_entries} per request. "
                "Lower n, max_tokens or top_logprobs, or send several requests",
                param="n",
                code="request_too_large",
            )
        temperature = 1.0 if request.temperature is None else request.temperature
        params = SamplingParams(
            max_tokens=limit,
            temperature=temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            seed=request.seed,
            stop=tuple(request.stop_list),
            top_logprobs=request.top_logprobs or 0,
            **processing(self.engine, request, limit, self.exact_sampling),
        )
        agent = (request.agentjet.agent if request.agentjet else None) or DEFAULT_AGENT
        params = replace(params, adapter=adapter_for(self.engine, request.model, agent))
        reader = None
        if not self.parser.builtin:
            messages = message_dicts(request.messages)
            parser = self.parser

            def reader() -> ChoiceReader:
                made = parser.reader(messages, tools, request.tool_choice, prompt_ids)
                assert made is not None
                return made

        return PreparedRequest(
            prompt_ids, params, prefix, tools_active, bool(request.logprobs), prefix_status, drift, agent, reader
        )

    def prepare_text(self, request: CompletionRequest) -> list[PreparedRequest]:
        """One prepared request per prompt (text is tokenised as vLLM does, special tokens added)."""
        chat = self.engine.chat
        vocab = len(chat.tokenizer)
        agent = (request.agentjet.agent if request.agentjet else None) or DEFAULT_AGENT
        adapter = adapter_for(self.engine, request.model, agent)
        out = []
        for k, prompt in enumerate(request.prompts):
            where = "prompt" if len(request.prompts) == 1 else f"prompt[{k}]"
            if isinstance(prompt, str):
                if len(prompt) > self.max_prompt_chars:
                    raise InvalidRequestError(
                        f"{where} holds {len(prompt)} characters, more than fit in the model's context of "
                        f"{self.engine.max_context} tokens; shorten it",
                        param="prompt",
                        code="context_length_exceeded",
                    )
                ids: list[int] = chat.tokenizer.encode(prompt)
            else:
                if any(t >= vocab for t in prompt):
                    raise InvalidRequestError(
                        f"{where} holds token ids outside the vocabulary (0..{vocab - 1})", param="prompt"
                    )
                ids = list(prompt)
            if not ids:
                raise InvalidRequestError(f"{where} is empty; send some text or token ids", param="prompt")
            room = self.engine.max_context - len(ids)
            # max_tokens 0 (echo only): the engine samples one token, which the answer leaves out
            asked = max(request.max_tokens if request.max_tokens is not None else 16, 1)
            if room <= 0 or asked > room:
                raise InvalidRequestError(
                    f"{where} is {len(ids)} tokens and the model's context is {self.engine.max_context}: at most "
                    f"{max(room, 0)} tokens are left for the completion, max_tokens is {asked}; lower max_tokens "
                    "or shorten the prompt",
                    param="max_tokens",
                    code="context_length_exceeded",
                )
            params = SamplingParams(
                max_tokens=asked,
                temperature=1.0 if request.temperature is None else request.temperature,
                top_p=1.0 if request.top_p is None else request.top_p,
                seed=request.seed,
                stop=tuple(request.stop_list),
                top_logprobs=request.logprobs or 0,
                adapter=adapter,
                prompt_logprobs=bool(request.echo) and request.logprobs is not None,
                **processing(self.engine, request, asked, self.exact_sampling),
            )
            out.append(PreparedRequest(ids, params, "", False, request.logprobs is not None, agent=agent))
        entries = sum(request.n * p.params.max_tokens * (1 + p.params.top_logprobs) for p in out)
        if entries > self.max_token_entries:
            raise InvalidRequestError(
                f"this request could sample {entries} token entries (prompts x n x max_tokens x log-probs); the "
                f"server answers at most {self.max_token_entries} per request. Send fewer or smaller requests",
                param="n",
                code="request_too_large",
            )
        return out
