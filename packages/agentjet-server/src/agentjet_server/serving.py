"""Chat Completions over an engine: prompt rendering, sampling, detokenisation, tool calls, SSE.

Routes hand a validated ``ChatCompletionRequest`` to ``ChatService``; it returns a
``ChatCompletion`` or yields SSE frames. Each choice carries the ``agentjet`` extension with
the exact prompt and completion token ids, per-token log-probabilities and versions.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from agentjet_client.protocol import (
    INT64_MIN,
    AgentJetExtension,
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatMessage,
    Choice,
    ChoiceDelta,
    ChoiceLogprobs,
    ChunkChoice,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    ContextCounts,
    TextCompletion,
    TokenLogprob,
    ToolCallDelta,
    TopLogprob,
    Usage,
)
from agentjet_server.chat_format import TOOL_CALL_OPEN, forced_tool_prefix, parse_tool_calls, without_tool_calls
from agentjet_server.continuation import Status, continue_from
from agentjet_server.engine.base import Engine, SamplingParams, TokenEvent
from agentjet_server.errors import InvalidRequestError
from agentjet_server.metrics import ServingStats
from agentjet_server.parsing import ChoiceReader, Delta, OutputParser, Parsed
from agentjet_server.signing import DEFAULT_AGENT, Sample, SampleSigner

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


@dataclass
class _ChoiceState:
    """Everything sampled so far for one choice, and how much of its text has been sent."""

    engine: Engine
    prepared: PreparedRequest
    events: list[TokenEvent] = field(default_factory=list)
    text: str = ""
    sent: int = 0
    stopped_by_string: bool = False
    _text_ids: list[int] = field(default_factory=list)
    _prefix: int = 0  # incremental detokenisation window: ids[_prefix:_read] is already text
    _read: int = 0
    signer: SampleSigner | None = None
    family: ChoiceReader | None = None  # the model family's reader, when the server has one
    _fed: int = 0  # text and tokens handed to ``family`` while streaming
    _fed_ids: int = 0
    _answer: Parsed | None = None

    def __post_init__(self) -> None:
        if self.prepared.reader is not None:
            self.family = self.prepared.reader()

    def _decode(self, ids: list[int]) -> str:
        if self.family is not None and self.family.keep_special_tokens:
            return self.engine.chat.decode_all(ids)  # the family's parser reads its special tokens as text
        return self.engine.decode(ids)

    @property
    def ids(self) -> list[int]:
        return [e.token_id for e in self.events]

    def add(self, event: TokenEvent) -> None:
        """Take one token; extend ``text`` by what it completes (a window decode, not the whole)."""
        self.events.append(event)
        if self.stopped_by_string:
            return
        if not self.engine.is_stop_token(event.token_id):
            self._text_ids.append(event.token_id)
        before = len(self.text)
        done = self._decode(self._text_ids[self._prefix : self._read])
        grown = self._decode(self._text_ids[self._prefix :])
        final = event.finish_reason is not None
        # a byte-level token can end inside a UTF-8 character: wait for the rest unless finished
        if len(grown) > len(done) and (final or not grown.endswith("\ufffd")):
            self.text += grown[len(done) :]
            self._prefix, self._read = self._read, len(self._text_ids)
        stops = self.prepared.params.stop
        if stops:
            start = max(0, before - max(len(x) for x in stops) + 1)
            cut = _earliest_stop(self.text[start:], stops)
            if cut is not None:
                self.text, self.stopped_by_string = self.text[: start + cut], True

    def sendable(self, final: bool) -> str:
        """New text safe to stream: no partial UTF-8, no possible stop-string prefix, no tool call."""
        end = len(self.text)
        if self.prepared.tools_active:
            if self.prepared.forced_prefix:
                end = 0  # the whole turn is a tool call: hold it for parsing
            elif (pos := self.text.find(TOOL_CALL_OPEN)) >= 0:
                end = pos
        if not final:
            hold = max((len(s) for s in self.prepared.params.stop), default=1) - 1
            end = min(end, max(len(self.text) - hold, self.sent))
        delta = self.text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return delta

    @property
    def finish(self) -> str:
        last = self.events[-1].finish_reason if self.events else "length"
        return "stop" if self.stopped_by_string else (last or "length")

    def extension(self) -> AgentJetExtension:
        versions = [e.version for e in self.events]
        ids, logprobs = self.ids, [e.logprob for e in self.events]
        finish = self.finish_reason()
        sample = Sample(self.prepared.prompt_ids, ids, logprobs, versions, finish, self.prepared.agent)
        return AgentJetExtension(
            prompt_token_ids=self.prepared.prompt_ids,
            completion_token_ids=ids,
            completion_logprobs=logprobs,
            completion_versions=versions,
            signature=self.signer.sign(sample) if self.signer else None,
            finish_reason=finish,
            policy_version=min(versions) if versions else self.engine.version,
            prefix=self.prepared.prefix_status,
            prefix_drift=self.prepared.prefix_drift,
        )

    def answer(self) -> Parsed:
        """Reasoning, content and tool calls of the whole answer (read once, when it is complete)."""
        if self._answer is None:
            if self.family is not None:
                self._answer = self.family.whole(self.text, self.ids)
            elif not self.prepared.tools_active:
                self._answer = Parsed(None, self.text, [])
            else:
                out = parse_tool_calls(self.prepared.forced_prefix + self.text)
                self._answer = Parsed(None, out.content, out.tool_calls)
        return self._answer

    def parsed(self) -> tuple[str | None, list[Any]]:
        answer = self.answer()
        return answer.content, answer.tool_calls

    def family_step(self, final: bool) -> Delta:
        """What the family's parser makes of the text and tokens sampled since the last step (text
        that could still become a stop string is held back until it cannot)."""
        assert self.family is not None
        end = len(self.text)
        if not final:
            hold = max((len(s) for s in self.prepared.params.stop), default=1) - 1
            end = max(end - hold, self._fed)
        delta_text, delta_ids = self.text[self._fed : end], [e.token_id for e in self.events[self._fed_ids :]]
        self._fed, self._fed_ids = end, len(self.events)
        if not (delta_text or delta_ids or final):
            return Delta()
        return self.family.step(delta_text, delta_ids, final)

    def finish_reason(self) -> Any:
        _, calls = self.parsed()
        return "tool_calls" if calls else self.finish

    def logprob_entries(self, events: list[TokenEvent]) -> list[TokenLogprob]:
        """One entry per sampled token, the end-of-turn token too (as vLLM lists it: the entries
        count ``usage.completion_tokens``), which is named by its special token text."""
        entries = []
        for event in events:
            if self.engine.is_stop_token(event.token_id):
                token = self.engine.chat.decode_all([event.token_id])
            else:
                token = self.engine.decode([event.token_id])
            entries.append(
                TokenLogprob(
                    token=token,
                    logprob=event.logprob,
                    bytes=list(token.encode()),
                    top_logprobs=[
                        TopLogprob(token=(t := self.engine.decode([tid])), logprob=lp, bytes=list(t.encode()))
                        for tid, lp in event.top_logprobs
                    ],
                )
            )
        return entries


def _earliest_stop(text: str, stops: tuple[str, ...]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
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


class ChatService:
    """Serves chat completions from one engine."""

    def __init__(
        self,
        engine: Engine,
        *,
        default_max_tokens: int = 512,
        signer: SampleSigner | None = None,
        max_token_entries: int = MAX_TOKEN_ENTRIES,
        stats: ServingStats | None = None,
        parser: OutputParser | None = None,
    ) -> None:
        self.engine = engine
        self.parser = parser or OutputParser()
        self.stats = stats  # counted on the event loop when given (``metrics``)
        self.signer = signer
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
        messages = _message_dicts(request.messages)
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

    def prepare(self, request: ChatCompletionRequest) -> PreparedRequest:
        """Render and tokenise the prompt and fix the sampling budget; every bound is checked here,
        before any token is sampled. CPU-bound: routes run it in a worker thread (``prepare_async``)."""
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
        )
        agent = (request.agentjet.agent if request.agentjet else None) or DEFAULT_AGENT
        reader = None
        if not self.parser.builtin:
            messages = _message_dicts(request.messages)
            parser = self.parser

            def reader() -> ChoiceReader:
                made = parser.reader(messages, tools, request.tool_choice, prompt_ids)
                assert made is not None
                return made

        return PreparedRequest(
            prompt_ids, params, prefix, tools_active, bool(request.logprobs), prefix_status, drift, agent, reader
        )

    def _params_for(self, prepared: PreparedRequest, index: int) -> SamplingParams:
        seed = prepared.params.seed
        if seed is None or index == 0:
            return prepared.params
        # choice i samples with seed + i, wrapped into the signed 64-bit range every sampler accepts
        wrapped = (seed + index - INT64_MIN) % (1 << 64) + INT64_MIN
        return SamplingParams(**{**prepared.params.__dict__, "seed": wrapped})

    def _generate(self, prepared: PreparedRequest, index: int) -> AsyncIterator[TokenEvent]:
        """The engine's token events for one choice, counted when ``stats`` is on."""
        events = self.engine.generate(prepared.prompt_ids, self._params_for(prepared, index))
        return events if self.stats is None else _counted(events, self.stats, len(prepared.prompt_ids))

    async def _run_choice(self, prepared: PreparedRequest, index: int) -> _ChoiceState:
        state = _ChoiceState(self.engine, prepared, signer=self.signer)
        async for event in self._generate(prepared, index):
            state.add(event)
            if state.stopped_by_string:
                break
        return state

    async def _interleaved(
        self, jobs: list[tuple[PreparedRequest, int]]
    ) -> AsyncGenerator[tuple[int, TokenEvent | None], None]:
        """``(job index, token event)`` of several choices sampled at once, in the order they come;
        ``None`` ends a job. A job's failure is raised here; closing this cancels the rest."""
        queue: asyncio.Queue[tuple[int, TokenEvent | BaseException | None]] = asyncio.Queue()

        async def pump(index: int) -> None:
            prepared, choice = jobs[index]
            try:
                async for event in self._generate(prepared, choice):
                    await queue.put((index, event))
                await queue.put((index, None))
            except BaseException as exc:  # handed to the consumer, which re-raises it
                await queue.put((index, exc))

        tasks = [asyncio.create_task(pump(i)) for i in range(len(jobs))]
        try:
            while True:
                index, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield index, item
        finally:
            for task in tasks:
                task.cancel()

    async def prepare_async(self, request: ChatCompletionRequest) -> PreparedRequest:
        """``prepare`` in a worker thread: rendering and tokenising a long conversation takes a while."""
        return await asyncio.to_thread(self.prepare, request)

    async def complete(self, request: ChatCompletionRequest, model_name: str) -> ChatCompletion:
        prepared = await self.prepare_async(request)
        states = await asyncio.gather(*(self._run_choice(prepared, i) for i in range(request.n)))
        # detokenising every token (and its top log-probs) of many choices is CPU work: off the event loop
        return await asyncio.to_thread(self._completion, prepared, states, model_name)

    def _completion(self, prepared: PreparedRequest, states: list[_ChoiceState], model_name: str) -> ChatCompletion:
        choices = []
        for index, state in enumerate(states):
            answer = state.answer()
            choices.append(
                Choice(
                    index=index,
                    message=AssistantMessage(
                        content=answer.content,
                        tool_calls=answer.tool_calls or None,
                        reasoning=answer.reasoning,
                        reasoning_content=answer.reasoning,
                    ),
                    logprobs=ChoiceLogprobs(content=state.logprob_entries(state.events))
                    if prepared.want_logprobs
                    else None,
                    finish_reason=state.finish_reason(),
                    agentjet=state.extension(),
                )
            )
        completion_tokens = sum(len(s.events) for s in states)
        return ChatCompletion(
            id=f"chatcmpl-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=model_name,
            choices=choices,
            usage=Usage(
                prompt_tokens=len(prepared.prompt_ids),
                completion_tokens=completion_tokens,
                total_tokens=len(prepared.prompt_ids) + completion_tokens,
            ),
        )

    async def stream(self, request: ChatCompletionRequest, model_name: str) -> AsyncIterator[str]:
        """SSE frames, token by token; choices of ``n > 1`` interleave as they are sampled."""
        async for chunk in self.stream_chunks(request, model_name):
            yield f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"
        yield "data: [DONE]\n\n"

    async def stream_chunks(
        self, request: ChatCompletionRequest, model_name: str
    ) -> AsyncIterator[ChatCompletionChunk]:
        """The chunks of a streamed answer (what ``stream`` sends; the other APIs translate them)."""
        prepared = await self.prepare_async(request)
        chunk_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def frame(choices: list[ChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=chunk_id, created=created, model=model_name, choices=choices, usage=usage)

        states = [_ChoiceState(self.engine, prepared, signer=self.signer) for _ in range(request.n)]
        for index in range(request.n):
            yield frame([ChunkChoice(index=index, delta=ChoiceDelta(role="assistant", content=""))])
        events = self._interleaved([(prepared, i) for i in range(request.n)])
        try:
            open_choices = set(range(request.n))
            while open_choices:
                index, item = await anext(events)
                if index not in open_choices:
                    continue
                state = states[index]
                if item is not None:
                    state.add(item)
                done = item is None or item.finish_reason is not None or state.stopped_by_string
                logprobs = None
                if prepared.want_logprobs and item is not None:
                    logprobs = ChoiceLogprobs(content=state.logprob_entries([item]))
                if state.family is not None:
                    step = state.family_step(final=done)
                    thought = step.reasoning or None
                    if step.content or thought or (logprobs and logprobs.content):
                        yield frame(
                            [
                                ChunkChoice(
                                    index=index,
                                    delta=ChoiceDelta(
                                        content=step.content, reasoning=thought, reasoning_content=thought
                                    ),
                                    logprobs=logprobs,
                                )
                            ]
                        )
                else:
                    delta = state.sendable(final=done)
                    if delta or (logprobs and logprobs.content):
                        yield frame([ChunkChoice(index=index, delta=ChoiceDelta(content=delta), logprobs=logprobs)])
                if done:
                    open_choices.discard(index)
                    for chunk in final_frames(frame, index, state):
                        yield chunk
            if request.stream_options and request.stream_options.include_usage:
                completion_tokens = sum(len(s.events) for s in states)
                yield frame(
                    [],
                    Usage(
                        prompt_tokens=len(prepared.prompt_ids),
                        completion_tokens=completion_tokens,
                        total_tokens=len(prepared.prompt_ids) + completion_tokens,
                    ),
                )
        finally:
            await events.aclose()

    # --- text completions (``POST /v1/completions``): no chat template, as vLLM serves them ---

    def prepare_text(self, request: CompletionRequest) -> list[PreparedRequest]:
        """One prepared request per prompt (text is tokenised as vLLM does, special tokens added)."""
        chat = self.engine.chat
        vocab = len(chat.tokenizer)
        agent = (request.agentjet.agent if request.agentjet else None) or DEFAULT_AGENT
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
            asked = request.max_tokens or 16
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

    async def complete_text(self, request: CompletionRequest, model_name: str) -> TextCompletion:
        prepared = await asyncio.to_thread(self.prepare_text, request)
        jobs = [self._run_choice(p, j) for p in prepared for j in range(request.n)]
        states = await asyncio.gather(*jobs)
        return await asyncio.to_thread(self._text_completion, states, model_name)

    def _text_completion(self, states: list[_ChoiceState], model_name: str) -> TextCompletion:
        choices = [
            CompletionChoice(
                index=i,
                text=state.text,
                logprobs=self._legacy_logprobs(state, state.events, 0) if state.prepared.want_logprobs else None,
                finish_reason=state.finish_reason(),
                agentjet=state.extension(),
            )
            for i, state in enumerate(states)
        ]
        prompt_tokens = sum(len(p.prompt_ids) for p in {id(s.prepared): s.prepared for s in states}.values())
        completion_tokens = sum(len(s.events) for s in states)
        return TextCompletion(
            id=f"cmpl-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=model_name,
            choices=choices,
            usage=Usage(
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
                total_tokens=prompt_tokens + completion_tokens,
            ),
        )

    @staticmethod
    def _legacy_logprobs(state: _ChoiceState, events: list[TokenEvent], offset: int) -> CompletionLogprobs:
        """Text completions' log-probability shape (tokens, their log-probs, top ones, text offsets)."""
        entries = state.logprob_entries(events)
        offsets = []
        for entry in entries:
            offsets.append(offset)
            offset += len(entry.token)
        return CompletionLogprobs(
            tokens=[e.token for e in entries],
            token_logprobs=[e.logprob for e in entries],
            top_logprobs=[{t.token: t.logprob for t in e.top_logprobs} for e in entries]
            if state.prepared.params.top_logprobs
            else None,
            text_offset=offsets,
        )

    async def stream_text(self, request: CompletionRequest, model_name: str) -> AsyncIterator[str]:
        """SSE frames of text completions, token by token; choices interleave as they are sampled."""
        prepared = await asyncio.to_thread(self.prepare_text, request)
        chunk_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        pairs = [(p, j) for p in prepared for j in range(request.n)]

        def frame(choices: list[CompletionChoice], usage: Usage | None = None) -> str:
            chunk = TextCompletion(id=chunk_id, created=created, model=model_name, choices=choices, usage=usage)
            return f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"

        states = [_ChoiceState(self.engine, p, signer=self.signer) for p, _ in pairs]
        offsets = [0] * len(pairs)
        yield ""  # prepared: the route starts the 200 stream (request errors were raised above)
        events = self._interleaved(pairs)
        try:
            open_choices = set(range(len(pairs)))
            while open_choices:
                index, item = await anext(events)
                if index not in open_choices:
                    continue
                state = states[index]
                if item is not None:
                    state.add(item)
                done = item is None or item.finish_reason is not None or state.stopped_by_string
                delta = state.sendable(final=done)
                logprobs = None
                if state.prepared.want_logprobs and item is not None:
                    logprobs = self._legacy_logprobs(state, [item], offsets[index])
                    offsets[index] += sum(len(t) for t in logprobs.tokens)
                if delta or logprobs is not None:
                    yield frame([CompletionChoice(index=index, text=delta, logprobs=logprobs)])
                if done:
                    open_choices.discard(index)
                    ext = state.extension()
                    yield frame([CompletionChoice(index=index, text="", finish_reason=ext.finish_reason, agentjet=ext)])
            if request.stream_options and request.stream_options.include_usage:
                prompt_tokens = sum(len(p.prompt_ids) for p in prepared)
                completion_tokens = sum(len(s.events) for s in states)
                yield frame(
                    [],
                    Usage(
                        prompt_tokens=prompt_tokens,
                        completion_tokens=completion_tokens,
                        total_tokens=prompt_tokens + completion_tokens,
                    ),
                )
            yield "data: [DONE]\n\n"
        finally:
            await events.aclose()


async def _counted(
    events: AsyncIterator[TokenEvent], stats: ServingStats, prompt_tokens: int
) -> AsyncIterator[TokenEvent]:
    """``events``, counting the request, its tokens and the time to its first token."""
    stats.in_flight += 1
    stats.requests += 1
    stats.prompt_tokens += prompt_tokens
    started = time.perf_counter()
    first = True
    try:
        async for event in events:
            if first:
                stats.ttft.observe(time.perf_counter() - started)
                first = False
            stats.completion_tokens += 1
            yield event
    finally:
        stats.in_flight -= 1


def final_frames(frame: Any, index: int, state: _ChoiceState) -> list[ChatCompletionChunk]:
    """The closing frames of one choice: tool calls or held-back text, then finish and extension."""
    content, calls = state.parsed()
    out: list[ChatCompletionChunk] = []
    if state.family is not None:
        # reasoning and content were streamed as the family's parser read them; the calls come whole
        if calls:
            out.append(frame([ChunkChoice(index=index, delta=ChoiceDelta(tool_calls=_call_deltas(calls)))]))
    elif calls:
        # text around the calls that was held back: a streamed answer has the content a whole one has
        if state.prepared.forced_prefix or state.sent == 0:
            rest = content or ""
        else:
            rest = without_tool_calls(state.text[state.sent :]).rstrip()
        if rest:
            out.append(frame([ChunkChoice(index=index, delta=ChoiceDelta(content=rest))]))
        out.append(frame([ChunkChoice(index=index, delta=ChoiceDelta(tool_calls=_call_deltas(calls)))]))
    else:
        # held back for tool parsing but not a valid call: it is plain content after all
        rest = (content or "") if state.prepared.forced_prefix else state.text[state.sent :]
        if rest:
            out.append(frame([ChunkChoice(index=index, delta=ChoiceDelta(content=rest))]))
    ext = state.extension()
    out.append(frame([ChunkChoice(index=index, delta=ChoiceDelta(), finish_reason=ext.finish_reason, agentjet=ext)]))
    return out


def _call_deltas(calls: list[Any]) -> list[ToolCallDelta]:
    return [
        ToolCallDelta(
            index=i,
            id=call.id,
            type="function",
            function={"name": call.function.name, "arguments": call.function.arguments},
        )
        for i, call in enumerate(calls)
    ]
