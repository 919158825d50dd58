"""LLM judges: rewards for tasks that have no checker, from any OpenAI-compatible endpoint.

    judge = GroupJudge("http://127.0.0.1:8100/v1", "judge-model",
                       "Prefer the answer a support engineer would send as is.")

    @swarm_agent(tasks="tickets.jsonl", reward=judge)
    async def reply(task, episode):
        ...
        return answer_text            # what the judge reads

``Judge`` scores each episode's result on its own; ``GroupJudge`` scores a whole GRPO group in one call,
the candidates against each other (as ART's RULER does): relative scores are what GRPO uses anyway, and
one call per group costs a fraction of one per episode. Both send the task and the results (a string
as it is, anything else as JSON) and read back ``{"scores": [...]}``, one number from 0 to 1 per
candidate.

The endpoint is any server of the OpenAI chat API: a hosted model (its key from the environment:
``api_key_env``), ``vllm serve``, or an ``agentjet-server up --serve-only`` that serves a frozen model
and never learns. Judge calls are not made through the episode, so they are never part of a
trajectory and never trained. The runner's judging stage (``judging``) takes the episodes from the
spool, calls the judge (at most ``concurrency`` calls at once, each retried with backoff by the SDK),
keeps every answer in the spool by content (the same group judged again makes no call) and counts
calls, tokens and seconds, those of failed calls included.

A judge must follow the instructions: reply with the JSON object, nothing but it. A model that does not
(any of the embedded models: they were warmed up on digits and tool calls, never on judging) is
stopped after ``max_unparsed`` answers in a row without usable scores: the run ends with that error
and the episodes wait in the spool for a run with a judge that can.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agentjet_client.errors import AgentJetError

DEFAULT_KEY_ENV = "AGENTJET_JUDGE_API_KEY"
INSTRUCTIONS = (
    "You score candidate results of one task, each from 0 (worst) to 1 (best), by the criteria given. "
    'Reply with one JSON object and nothing else: {"scores": [...]}, one number per candidate, in order.'
)
GROUP_INSTRUCTIONS = (
    " The candidates are attempts at the same task: compare them with each other, and give the better "
    "ones higher scores, so that the scores rank them."
)


class JudgeError(AgentJetError):
    """A judge did not answer, or its answer held no usable scores (the episodes wait and are judged again)."""

    def __init__(self, message: str, cost: Verdict | None = None, unparsed: bool = False) -> None:
        super().__init__(message)
        self.cost = cost  # what the failed call cost (tokens, seconds), where it was answered
        self.unparsed = unparsed  # the judge answered, without usable scores


class JudgeUnfit(AgentJetError):
    """A judge whose answers do not parse, ``max_unparsed`` times in a row: it cannot judge (the run stops)."""


@dataclass
class Verdict:
    """A judge's scores for the candidates it was given, and what the call cost."""

    scores: list[float]
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0
    explanation: str = ""


def show(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str, sort_keys=True)


def parse_scores(text: str, count: int) -> list[float]:
    """``count`` scores from a judge's answer: ``{"scores": [...]}`` (or ``{"score": x}`` for one), anywhere
    in the text; each clipped to [0, 1]. Raises JudgeError with what was wrong."""
    candidates = [text, *re.findall(r"\{.*?\}", text, flags=re.DOTALL), *re.findall(r"\{.*\}", text, re.DOTALL)]
    for candidate in candidates:
        try:
            data = json.loads(candidate)
        except ValueError:
            continue
        if not isinstance(data, dict):
            continue
        scores = data.get("scores", [data["score"]] if "score" in data and count == 1 else None)
        if not isinstance(scores, list) or len(scores) != count:
            continue
        if all(isinstance(s, int | float) and not isinstance(s, bool) and math.isfinite(s) for s in scores):
            return [min(1.0, max(0.0, float(s))) for s in scores]
    raise JudgeError(f'its answer holds no {{"scores": [...]}} with {count} numbers: {text[:120]!r}')


class Judge:
    """An LLM judge scoring each episode's result on its own (see the module docstring)."""

    group = False

    def __init__(
        self,
        url: str,
        model: str,
        prompt: str,
        *,
        api_key: str | None = None,
        api_key_env: str = DEFAULT_KEY_ENV,
        concurrency: int = 8,
        retries: int = 4,
        timeout: float = 120.0,
        max_tokens: int = 1024,
        temperature: float = 0.0,
        show_task: Callable[[Any], str] = show,
        group_timeout: float = 600.0,
        cache: bool = True,
        max_unparsed: int = 5,
    ) -> None:
        if concurrency < 1 or retries < 0 or timeout <= 0 or max_unparsed < 1:
            raise ValueError("a judge needs concurrency >= 1, retries >= 0, a timeout above 0 and max_unparsed >= 1")
        self.url, self.model, self.prompt = url.rstrip("/"), model, prompt
        self._api_key, self._api_key_env = api_key, api_key_env
        self.concurrency, self.retries, self.timeout = concurrency, retries, timeout
        self.max_tokens, self.temperature = max_tokens, temperature
        self.show_task = show_task
        self.group_timeout = group_timeout  # a group still incomplete after this long is judged as it is
        self.cache = cache  # False: every judging calls (a judge that samples, or to measure its cost)
        self.max_unparsed = max_unparsed  # answers in a row without usable scores before the run stops
        self._client: Any = None
        self._gate: asyncio.Semaphore | None = None

    @property
    def fingerprint(self) -> str:
        """What decides a judge's answers besides the candidates: a changed prompt or model judges anew."""
        what = [type(self).__name__, self.model, self.prompt, self.temperature, self.max_tokens]
        return hashlib.sha256(json.dumps(what).encode()).hexdigest()[:16]

    def key(self, task: Any, results: list[Any]) -> str:
        """The cache key of judging ``results`` of ``task``."""
        body = json.dumps([self.fingerprint, show(task), [show(r) for r in results]], ensure_ascii=False)
        return hashlib.sha256(body.encode()).hexdigest()

    def messages(self, task: Any, results: list[Any]) -> list[dict[str, str]]:
        system = f"{self.prompt.strip()}\n\n{INSTRUCTIONS}{GROUP_INSTRUCTIONS if self.group else ''}"
        parts = [f"Task:\n{self.show_task(task)}"]
        parts += [f"Candidate {i}:\n{show(result)}" for i, result in enumerate(results, 1)]
        parts.append(f'Reply with {{"scores": [...]}} holding {len(results)} numbers.')
        return [{"role": "system", "content": system}, {"role": "user", "content": "\n\n".join(parts)}]

    def _sdk(self) -> Any:
        if self._client is None:
            import openai

            key = self._api_key or os.environ.get(self._api_key_env) or "none"
            self._client = openai.AsyncOpenAI(
                base_url=self.url, api_key=key, max_retries=self.retries, timeout=self.timeout
            )
        return self._client

    async def judge(self, task: Any, results: list[Any]) -> Verdict:
        """One call: the scores of ``results`` (raises JudgeError when the judge cannot be used now)."""
        import openai

        if self._gate is None:
            self._gate = asyncio.Semaphore(self.concurrency)
        started = time.monotonic()
        async with self._gate:
            try:
                reply = await self._sdk().chat.completions.create(
                    model=self.model,
                    messages=self.messages(task, results),
                    max_tokens=self.max_tokens,
                    temperature=self.temperature,
                )
            except openai.OpenAIError as exc:
                cost = Verdict([], seconds=time.monotonic() - started)
                raise JudgeError(f"the judge at {self.url} ({self.model}) failed: {exc}", cost) from exc
        text = (reply.choices[0].message.content or "") if reply.choices else ""
        usage = reply.usage
        verdict = Verdict(
            [],
            prompt_tokens=usage.prompt_tokens if usage else 0,
            completion_tokens=usage.completion_tokens if usage else 0,
            seconds=time.monotonic() - started,
            explanation=text[:2000],
        )
        try:
            verdict.scores = parse_scores(text, len(results))
        except JudgeError as exc:
            raise JudgeError(f"the judge at {self.url} ({self.model}): {exc}", verdict, unparsed=True) from None
        return verdict

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None
        self._gate = None  # of the event loop that is ending


class GroupJudge(Judge):
    """An LLM judge scoring a whole GRPO group in one call, the candidates against each other."""

    group = True
