"""One choice as it is sampled, and the sampling of several at once.

``ChoiceState`` holds what was sampled for one choice: the token events, the text decoded so far
(incremental, safe at UTF-8 and stop-string boundaries), what of it was sent, and the finished answer
(content, reasoning, tool calls) with its ``agentjet`` extension. ``Sampler`` runs choices on the engine:
whole (``sample``) or interleaved token by token (``stream``: the one loop that chat and text streams
share).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from agentjet_client.protocol import INT64_MIN, AgentJetExtension, TokenLogprob, TopLogprob, Usage
from agentjet_server.engine.base import Engine, SamplingParams, TokenEvent
from agentjet_server.ingest.signing import Sample, SampleSigner
from agentjet_server.observe.metrics import ServingStats
from agentjet_server.serving.chat_format import TOOL_CALL_OPEN, parse_tool_calls
from agentjet_server.serving.parsing import ChoiceReader, Delta, Parsed
from agentjet_server.serving.prompt import PreparedRequest


@dataclass
class ChoiceState:
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
    # an answer sent whole with no stop strings needs no text until it is complete: one decode then
    # instead of two per token
    held: bool = False

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
        """Take one token; extend ``text`` by what it completes (a window decode, not the whole). A choice
        that is ``held`` is decoded once, when it is complete (``settle``)."""
        self.events.append(event)
        if self.stopped_by_string:
            return
        if not self.engine.is_stop_token(event.token_id):
            self._text_ids.append(event.token_id)
        if self.held:
            return
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
            cut = earliest_stop(self.text[start:], stops)
            if cut is not None:
                self.text, self.stopped_by_string = self.text[: start + cut], True

    def settle(self) -> None:
        """The text of a ``held`` choice, decoded whole now that it is complete."""
        if self.held:
            self.text, self.held = self._decode(self._text_ids), False

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
        # the behaviour policy's log-probs: the processed distribution's where the settings changed it
        processed = self.prepared.params.processed
        ids = self.ids
        logprobs = [e.logprob if e.behaviour is None else e.behaviour for e in self.events]
        finish = self.finish_reason()
        adapter = self.prepared.params.adapter
        sample = Sample(
            self.prepared.prompt_ids, ids, logprobs, versions, finish, self.prepared.agent, processed, adapter
        )
        now = self.engine.version if adapter is None else self.engine.adapter_version(adapter)
        return AgentJetExtension(
            prompt_token_ids=self.prepared.prompt_ids,
            completion_token_ids=ids,
            completion_logprobs=logprobs,
            completion_versions=versions,
            sampled_from="processed" if processed else None,
            signature=self.signer.sign(sample) if self.signer else None,
            finish_reason=finish,
            policy_version=min(versions) if versions else now,
            adapter=adapter,
            max_tokens=self.prepared.params.max_tokens,
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

    def malformed_call(self) -> bool | None:
        """None for an answer to a request without tools; else whether the answer opened a tool call
        (its parser's start marker) that the parser could not read (``observe.tool_calls``)."""
        if not self.prepared.tools_active:
            return None
        if self.answer().tool_calls:
            return False
        marker = self.family.call_marker() if self.family is not None else TOOL_CALL_OPEN
        return marker is not None and marker in self.prepared.forced_prefix + self.text

    @property
    def version(self) -> int:
        """The policy version that sampled the answer (its oldest token's)."""
        return min((e.version for e in self.events), default=self.engine.version)

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


def earliest_stop(text: str, stops: tuple[str, ...]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def usage(prompt_tokens: int, states: Sequence[ChoiceState]) -> Usage:
    completion_tokens = sum(len(s.events) for s in states)
    return Usage(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens
    )


class Sampler:
    """Samples prepared requests on one engine, signing each choice and counting it (``stats``)."""

    def __init__(
        self, engine: Engine, *, signer: SampleSigner | None = None, stats: ServingStats | None = None
    ) -> None:
        self.engine = engine
        self.signer = signer
        self.stats = stats  # counted on the event loop when given (``metrics``)

    def state(self, prepared: PreparedRequest) -> ChoiceState:
        return ChoiceState(self.engine, prepared, signer=self.signer)

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
        return events if self.stats is None else counted(events, self.stats, len(prepared.prompt_ids))

    async def _run_choice(self, prepared: PreparedRequest, index: int) -> ChoiceState:
        state = self.state(prepared)
        state.held = not prepared.params.stop  # nothing to watch for while it is sampled
        async for event in self._generate(prepared, index):
            state.add(event)
            if state.stopped_by_string:
                break
        state.settle()
        return state

    async def sample(self, jobs: Sequence[tuple[PreparedRequest, int]]) -> list[ChoiceState]:
        """Each ``(prepared request, choice index)`` sampled whole, all at once."""
        return list(await asyncio.gather(*(self._run_choice(prepared, index) for prepared, index in jobs)))

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

    async def stream(
        self, jobs: Sequence[tuple[PreparedRequest, int]], states: Sequence[ChoiceState]
    ) -> AsyncGenerator[tuple[int, TokenEvent | None, bool], None]:
        """``(job index, token event, done)`` as the jobs' tokens come, each already added to its state in
        ``states``; ``done`` once per job, with its last event (or None). Closing this cancels the rest."""
        events = self._interleaved(list(jobs))
        try:
            open_choices = set(range(len(jobs)))
            while open_choices:
                index, item = await anext(events)
                if index not in open_choices:
                    continue
                state = states[index]
                if item is not None:
                    state.add(item)
                done = item is None or item.finish_reason is not None or state.stopped_by_string
                if done:
                    open_choices.discard(index)
                yield index, item, done
        finally:
            await events.aclose()


async def counted(
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
