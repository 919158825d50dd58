"""Text completions (``POST /v1/completions``): prompts as text or token ids, no chat template, as vLLM
serves them; whole (``complete``) or streamed as SSE (``stream``), with the legacy log-probability shape."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator

from agentjet_client.protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, TextCompletion, Usage
from agentjet_server.engine.base import TokenEvent
from agentjet_server.errors import EngineError
from agentjet_server.serving.choice import ChoiceState, Sampler, usage
from agentjet_server.serving.prompt import PreparedRequest, PromptBuilder


def legacy_logprobs(state: ChoiceState, events: list[TokenEvent], offset: int) -> CompletionLogprobs:
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


def echoed(choice: CompletionChoice, state: ChoiceState, text: str | None, scored_only: bool) -> CompletionChoice:
    """``choice`` with its prompt in front (``text`` as sent, or the token ids' text) and, if log-probs were
    asked, each prompt token's (the engine's ``prompt_logprobs``; the first token's is None, as nothing
    predicts it). ``scored_only`` (max_tokens 0): the prompt alone, nothing sampled, no turn to train."""
    ids = state.prepared.prompt_ids
    chat = state.engine.chat
    prompt = text if text is not None else chat.decode_all(ids)
    logprobs = None
    if choice.logprobs is not None:
        scored = state.events[0].prompt_logprobs if state.events else None
        if scored is None or len(scored) != len(ids) - 1:
            raise EngineError("the engine did not score the prompt's tokens (echo with logprobs)")
        tokens = [chat.decode_all([t]) for t in ids]
        offsets = [0]
        for token in tokens[:-1]:
            offsets.append(offsets[-1] + len(token))
        values: list[float | None] = [None, *scored]
        tops: list[dict[str, float] | None] | None = None
        if choice.logprobs.top_logprobs is not None:  # a prompt token's own log-prob only (the engines score that)
            tops = [None, *({t: v} for t, v in zip(tokens[1:], scored, strict=True))]
        sampled = choice.logprobs
        if scored_only:
            logprobs = CompletionLogprobs(tokens=tokens, token_logprobs=values, top_logprobs=tops, text_offset=offsets)
        else:
            shift = len(prompt)
            logprobs = CompletionLogprobs(
                tokens=tokens + sampled.tokens,
                token_logprobs=values + sampled.token_logprobs,
                top_logprobs=None if tops is None else tops + (sampled.top_logprobs or []),
                text_offset=offsets + [o + shift for o in sampled.text_offset],
            )
    if scored_only:
        return CompletionChoice(index=choice.index, text=prompt, logprobs=logprobs, finish_reason="length")
    return choice.model_copy(update={"text": prompt + choice.text, "logprobs": logprobs})


def _prompt_tokens(prepared: list[PreparedRequest]) -> int:
    return sum(len(p.prompt_ids) for p in prepared)


class TextService:
    """Serves text completions: prompts from ``prompts``, tokens from ``sampler``."""

    def __init__(self, prompts: PromptBuilder, sampler: Sampler) -> None:
        self.prompts = prompts
        self.sampler = sampler

    async def complete(self, request: CompletionRequest, model_name: str) -> TextCompletion:
        prepared = await asyncio.to_thread(self.prompts.prepare_text, request)
        states = await self.sampler.sample([(p, j) for p in prepared for j in range(request.n)])
        return await asyncio.to_thread(self._completion, request, prepared, states, model_name)

    def _completion(
        self, request: CompletionRequest, prepared: list[PreparedRequest], states: list[ChoiceState], model_name: str
    ) -> TextCompletion:
        texts = request.prompts
        scored_only = request.max_tokens == 0  # the one token the engine sampled is left out
        choices = []
        for i, state in enumerate(states):
            choice = CompletionChoice(
                index=i,
                text=state.text,
                logprobs=legacy_logprobs(state, state.events, 0) if state.prepared.want_logprobs else None,
                finish_reason=state.finish_reason(),
                agentjet=state.extension(),
            )
            if request.echo:
                prompt = texts[i // request.n]
                choice = echoed(choice, state, prompt if isinstance(prompt, str) else None, scored_only)
            choices.append(choice)
        prompt_tokens = _prompt_tokens(prepared)
        counted = usage(prompt_tokens, states)
        if scored_only:  # nothing sampled is answered
            counted = Usage(prompt_tokens=prompt_tokens, completion_tokens=0, total_tokens=prompt_tokens)
        return TextCompletion(
            id=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()), model=model_name, choices=choices, usage=counted
        )

    async def stream(self, request: CompletionRequest, model_name: str) -> AsyncIterator[str]:
        """SSE frames of text completions, token by token; choices interleave as they are sampled."""
        prepared = await asyncio.to_thread(self.prompts.prepare_text, request)
        chunk_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        jobs = [(p, j) for p in prepared for j in range(request.n)]

        def frame(choices: list[CompletionChoice], usage: Usage | None = None) -> str:
            chunk = TextCompletion(id=chunk_id, created=created, model=model_name, choices=choices, usage=usage)
            return f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"

        states = [self.sampler.state(p) for p, _ in jobs]
        offsets = [0] * len(jobs)
        yield ""  # prepared: the route starts the 200 stream (request errors were raised above)
        async with contextlib.aclosing(self.sampler.stream(jobs, states)) as sampled:
            async for index, item, done in sampled:
                state = states[index]
                delta = state.sendable(final=done)
                logprobs = None
                if state.prepared.want_logprobs and item is not None:
                    logprobs = legacy_logprobs(state, [item], offsets[index])
                    offsets[index] += sum(len(t) for t in logprobs.tokens)
                if delta or logprobs is not None:
                    yield frame([CompletionChoice(index=index, text=delta, logprobs=logprobs)])
                if done:
                    ext = state.extension()
                    yield frame([CompletionChoice(index=index, text="", finish_reason=ext.finish_reason, agentjet=ext)])
        if request.stream_options and request.stream_options.include_usage:
            yield frame([], usage(_prompt_tokens(prepared), states))
        yield "data: [DONE]\n\n"
