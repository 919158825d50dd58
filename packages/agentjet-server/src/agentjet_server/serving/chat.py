"""Chat completions: a prepared chat request sampled whole (``complete``) or streamed as chunks
(``stream_chunks``: what ``stream`` sends as SSE, and what the Responses and Messages dialects translate).
Each choice carries the ``agentjet`` extension with the exact prompt and completion token ids, per-token
log-probabilities and versions."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any

from agentjet_client.protocol import (
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Choice,
    ChoiceDelta,
    ChoiceLogprobs,
    ChunkChoice,
    ToolCallDelta,
    Usage,
)
from agentjet_server.observe.tool_calls import ToolCallHealth
from agentjet_server.serving.chat_format import without_tool_calls
from agentjet_server.serving.choice import ChoiceState, Sampler, usage
from agentjet_server.serving.prompt import PreparedRequest, PromptBuilder

# a prompt seen lately, of at most this many characters, is prepared on the event loop (``ChatTokenizer`` kept
# its ids, so preparing it costs less than the hop to a worker thread and back); any other is prepared in a
# worker thread; an answer of at most this many token entries is built on the event loop
SEEN_PROMPTS = 4096
INLINE_PROMPT_CHARS = 1 << 16
INLINE_ANSWER_ENTRIES = 256


def fingerprint(request: ChatCompletionRequest) -> tuple[int, int]:
    """A hash of the conversation's roles and text and of whether it has tools, and its characters: which
    prompts were sent before (a hint for where to prepare one; what the tokenizer keeps is keyed exactly)."""
    texts = tuple((m.role, m.text()) for m in request.messages)
    return hash((bool(request.tools), texts)), sum(len(text) for _, text in texts)


def answer_entries(prepared: PreparedRequest, states: list[ChoiceState]) -> int:
    """How many token entries building the answer decodes: each token, and its top log-probs if asked."""
    per_token = 1 + (1 + prepared.params.top_logprobs if prepared.want_logprobs else 0)
    return per_token * sum(len(state.events) for state in states)


class ChatService:
    """Serves chat completions: prompts from ``prompts``, tokens from ``sampler``; each answer to a
    request with tools is counted in ``tool_calls`` (malformed calls among them)."""

    def __init__(self, prompts: PromptBuilder, sampler: Sampler, tool_calls: ToolCallHealth | None = None) -> None:
        self.prompts = prompts
        self.sampler = sampler
        self.tool_calls = tool_calls
        self._seen: OrderedDict[int, None] = OrderedDict()  # prompts sent lately (``fingerprint``), newest last

    def _count(self, state: ChoiceState) -> None:
        malformed = state.malformed_call() if self.tool_calls is not None else None
        if self.tool_calls is not None and malformed is not None:
            self.tool_calls.record(state.prepared.agent, state.version, malformed)

    async def prepare(self, request: ChatCompletionRequest) -> PreparedRequest:
        """``PromptBuilder.prepare_chat``: a prompt sent lately here (its ids are kept), any other in a worker
        thread (rendering and tokenising a conversation takes a while)."""
        key, chars = fingerprint(request)
        if key in self._seen and chars <= INLINE_PROMPT_CHARS:
            self._seen.move_to_end(key)
            return self.prompts.prepare_chat(request)
        prepared = await asyncio.to_thread(self.prompts.prepare_chat, request)
        self._seen[key] = None
        if len(self._seen) > SEEN_PROMPTS:
            self._seen.popitem(last=False)
        return prepared

    async def complete(self, request: ChatCompletionRequest, model_name: str) -> ChatCompletion:
        prepared = await self.prepare(request)
        states = await self.sampler.sample([(prepared, i) for i in range(request.n)])
        # detokenising every token (and its top log-probs) of many choices is CPU work: off the event loop
        if answer_entries(prepared, states) <= INLINE_ANSWER_ENTRIES:
            completion = self._completion(prepared, states, model_name)
        else:
            completion = await asyncio.to_thread(self._completion, prepared, states, model_name)
        for state in states:
            self._count(state)
        return completion

    def _completion(self, prepared: PreparedRequest, states: list[ChoiceState], model_name: str) -> ChatCompletion:
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
        return ChatCompletion(
            id=f"chatcmpl-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=model_name,
            choices=choices,
            usage=usage(len(prepared.prompt_ids), states),
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
        prepared = await self.prepare(request)
        chunk_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def frame(choices: list[ChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=chunk_id, created=created, model=model_name, choices=choices, usage=usage)

        states = [self.sampler.state(prepared) for _ in range(request.n)]
        for index in range(request.n):
            yield frame([ChunkChoice(index=index, delta=ChoiceDelta(role="assistant", content=""))])
        jobs = [(prepared, i) for i in range(request.n)]
        async with contextlib.aclosing(self.sampler.stream(jobs, states)) as sampled:
            async for index, item, done in sampled:
                state = states[index]
                logprobs = None
                if prepared.want_logprobs and item is not None:
                    logprobs = ChoiceLogprobs(content=state.logprob_entries([item]))
                if state.family is not None:
                    step = state.family_step(final=done)
                    thought = step.reasoning or None
                    if step.content or thought or (logprobs and logprobs.content):
                        delta = ChoiceDelta(content=step.content, reasoning=thought, reasoning_content=thought)
                        yield frame([ChunkChoice(index=index, delta=delta, logprobs=logprobs)])
                else:
                    text = state.sendable(final=done)
                    if text or (logprobs and logprobs.content):
                        yield frame([ChunkChoice(index=index, delta=ChoiceDelta(content=text), logprobs=logprobs)])
                if done:
                    for chunk in final_frames(frame, index, state):
                        yield chunk
                    self._count(state)
        if request.stream_options and request.stream_options.include_usage:
            yield frame([], usage(len(prepared.prompt_ids), states))


def final_frames(
    frame: Callable[..., ChatCompletionChunk], index: int, state: ChoiceState
) -> list[ChatCompletionChunk]:
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
