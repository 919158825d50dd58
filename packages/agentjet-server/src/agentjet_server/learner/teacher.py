"""A distillation teacher behind HTTP: any OpenAI-compatible ``/v1/completions`` that scores a prompt.

``--teacher URL`` names another server (another AgentJet server, vLLM's OpenAI server, or anything that
answers ``echo`` with ``logprobs`` as they do). Before a step, ``RemoteTeacher.score`` sends each of the
batch's sequences as token ids, ``max_tokens`` 0 with ``echo`` and ``logprobs`` 0, and keeps the teacher's
log-probability of every trained token (``Sequence.teacher_logprobs``); the learner then adds
``coef * (log pi_teacher - log pi_behaviour)`` to those tokens' advantages as it does for a local teacher.
The requests go out together (up to ``concurrency`` at a time); the teacher's prefix cache shares the
prompts that a group's samples have in common.

The teacher must use the student's tokenizer: log-probs are compared token by token. ``connect`` checks
what it can (the teacher answers, serves the model, and splits a sample text into as many tokens).
A teacher that cannot be reached (connection errors, 5xx, after ``attempts`` tries) raises
``TeacherUnavailable``: the loop keeps the batch and tries it again later, so no episode is lost to an
outage; one that refuses a request (4xx) raises ``TeacherError`` with its message.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence as Seq
from typing import Any

import httpx2
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from agentjet_server.learner.batch import Sequence

SAMPLE_TEXT = "The teacher and the student split this sentence into the same tokens, 1 2 3."


class TeacherError(Exception):
    """The teacher refused a request, or answered something that is not a scored prompt."""


class TeacherUnavailable(TeacherError):
    """The teacher could not be reached (or kept failing) after every try."""


class RemoteTeacher:
    """Scores sequences with a teacher served over HTTP (see the module docstring)."""

    def __init__(
        self,
        url: str,
        model: str | None = None,
        api_key: str | None = None,
        *,
        concurrency: int = 16,
        timeout: float = 300.0,
        attempts: int = 3,
    ) -> None:
        self.url = url.rstrip("/")
        self.base = self.url if self.url.endswith("/v1") else self.url + "/v1"
        self.model = model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.concurrency = concurrency
        self.timeout = timeout
        self.attempts = attempts

    def connect(self, encode: Any) -> str:
        """Check the teacher before training starts: it answers, serves ``model`` (by default its first),
        and splits ``SAMPLE_TEXT`` into as many tokens as ``encode`` (the student's tokenizer) does. Returns
        the model name it will be asked for; raises ``TeacherError`` saying what to fix."""
        unreachable = f"the teacher at {self.url} cannot be reached"
        try:
            listed = httpx2.get(self.base + "/models", headers=self.headers, timeout=30)
        except httpx2.HTTPError as exc:
            raise TeacherError(f"{unreachable} ({exc}): start it, or fix --teacher") from exc
        if listed.status_code != 200:
            raise TeacherError(
                f"the teacher at {self.url} answered GET /v1/models: {listed.status_code} {listed.text[:200]}"
            )
        names = [m.get("id") for m in listed.json().get("data", [])]
        if self.model is None:
            if not names:
                raise TeacherError(f"the teacher at {self.url} lists no model: name one with --teacher-model")
            self.model = str(names[0])
        elif self.model not in names:
            raise TeacherError(f"the teacher at {self.url} serves {names}, not {self.model!r}: fix --teacher-model")
        ids = list(encode(SAMPLE_TEXT))
        body = {"model": self.model, "prompt": SAMPLE_TEXT, "max_tokens": 0, "echo": True, "logprobs": 0}
        try:
            reply = httpx2.post(self.base + "/completions", json=body, headers=self.headers, timeout=self.timeout)
        except httpx2.HTTPError as exc:
            raise TeacherError(f"{unreachable} ({exc}): start it, or fix --teacher") from exc
        if reply.status_code != 200:
            raise TeacherError(
                f"the teacher at {self.url} does not score prompts (echo with logprobs, max_tokens 0): "
                f"{reply.status_code} {reply.text[:300]}"
            )
        answer = reply.json()
        tokens = (((answer.get("choices") or [{}])[0]).get("logprobs") or {}).get("tokens") or []
        if len(tokens) != len(ids):
            raise TeacherError(
                f"the teacher {self.model!r} splits a sample text into {len(tokens)} tokens and the student into "
                f"{len(ids)}: distillation compares log-probs token by token, so it needs the student's tokenizer"
            )
        _prompt_logprobs(answer, len(ids))  # and it scores each of them
        return self.model

    def score(self, sequences: Seq[Sequence]) -> None:
        """Fill each sequence's ``teacher_logprobs`` (one per trained position), all requests together."""
        asyncio.run(self._score_all(sequences))

    async def _score_all(self, sequences: Seq[Sequence]) -> None:
        gate = asyncio.Semaphore(self.concurrency)
        limits = httpx2.Limits(max_connections=self.concurrency)
        async with httpx2.AsyncClient(headers=self.headers, timeout=self.timeout, limits=limits) as client:

            async def one(sequence: Sequence) -> None:
                async with gate:
                    sequence.teacher_logprobs = await self._score_one(client, sequence)

            await asyncio.gather(*(one(s) for s in sequences))

    async def _score_one(self, client: httpx2.AsyncClient, sequence: Sequence) -> list[float]:
        end = max(sequence.positions) + 1
        body = {"model": self.model, "prompt": sequence.tokens[:end], "max_tokens": 0, "echo": True, "logprobs": 0}
        answer = await self._post(client, body)
        values = _prompt_logprobs(answer, end)
        scored = [values[p] for p in sequence.positions]
        if any(v is None for v in scored):
            raise TeacherError("the teacher left a trained token unscored (a null log-prob after the first token)")
        return [float(v) for v in scored if v is not None]

    async def _post(self, client: httpx2.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
        """The teacher's answer; a connection error, 5xx or 429 is tried again (``attempts`` in all, 1 s,
        2 s, 4 s ... apart, at most 10 s), then raises TeacherUnavailable; another refusal raises at once."""
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self.attempts),
            wait=wait_exponential(multiplier=1, max=10),
            retry=retry_if_exception_type(_Again),
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    return await self._post_once(client, body)
        except _Again as exc:
            raise TeacherUnavailable(f"the teacher at {self.url} failed {self.attempts} times, last: {exc}") from None
        raise AssertionError("tenacity ends in an answer or an exception")  # pragma: no cover

    async def _post_once(self, client: httpx2.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
        try:
            reply = await client.post(self.base + "/completions", json=body)
        except httpx2.HTTPError as exc:
            raise _Again(f"{type(exc).__name__}: {exc}") from exc
        if reply.status_code == 200:
            answer: dict[str, Any] = reply.json()
            return answer
        if reply.status_code < 500 and reply.status_code != 429:
            raise TeacherError(f"the teacher refused to score ({reply.status_code}): {reply.text[:300]}")
        raise _Again(f"{reply.status_code}: {reply.text[:200]}")


class _Again(Exception):
    """A teacher call worth trying again (unreachable, 5xx, 429): its message is what went wrong."""


def _prompt_logprobs(answer: dict[str, Any], length: int) -> list[float | None]:
    """The echoed prompt's ``length`` log-probs from a completions answer (the first is null)."""
    try:
        values: list[float | None] = answer["choices"][0]["logprobs"]["token_logprobs"]
    except (KeyError, IndexError, TypeError) as exc:
        raise TeacherError("the teacher's answer has no choices[0].logprobs.token_logprobs: does it echo?") from exc
    if len(values) < length:
        raise TeacherError(f"the teacher scored {len(values)} of the prompt's {length} tokens: does it echo?")
    return values[:length]
