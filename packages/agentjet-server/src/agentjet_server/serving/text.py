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
        return await asyncio.to_thread(self._completion, prepared, states, model_name)

    def _completion(
        self, prepared: list[PreparedRequest], states: list[ChoiceState], model_name: str
    ) -> TextCompletion:
        choices = [
            CompletionChoice(
                index=i,
                text=state.text,
                logprobs=legacy_logprobs(state, state.events, 0) if state.prepared.want_logprobs else None,
                finish_reason=state.finish_reason(),
                agentjet=state.extension(),
            )
            for i, state in enumerate(states)
        ]
        return TextCompletion(
            id=f"cmpl-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=model_name,
            choices=choices,
            usage=usage(_prompt_tokens(prepared), states),
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
