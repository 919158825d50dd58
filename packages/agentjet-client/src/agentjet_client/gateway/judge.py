"""A judge for the sessions that get no feedback: ``agentjet-client gateway --judge-url URL --judge-model M``.

A session that has ended (closed, or idle for ``--idle``) and got no feedback for ``--judge-after``
seconds more is shown to an LLM judge (``judges.Judge``: any OpenAI-compatible endpoint): the task is
the conversation its first call opened with, the result what the user was finally answered (the last
call's conversation and its answer). The judge's score finishes the session as feedback would, and it is
counted as ``judged`` (of ``trained``). With ``--fan-out N`` a session that stayed single-turn is judged
as a group: its N candidates side by side, one score each (``candidate_rewards``), the "judged turns" case
that fan-out is valid for.

Feedback that arrives first wins; feedback that arrives while the judge reads gets the judged session's
answer (a 409 if its reward differs). A judge that fails (down, or an answer without scores) is asked
again later, with backoff, until the session's ``--ttl`` expires it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from agentjet_client.gateway.episodes import FeedbackError
from agentjet_client.gateway.sessions import LiveSession, SessionBook
from agentjet_client.protocol import Feedback
from agentjet_client.tasks.judges import Judge, JudgeError

logger = logging.getLogger(__name__)

FIRST_BACKOFF_S = 5.0
MAX_BACKOFF_S = 300.0


def shown_answer(answer: Any) -> Any:
    """An answer (text, tool calls) as the judge reads it: the text, or the text and the calls."""
    text, tool_calls = answer if answer else ("", ())
    if not tool_calls:
        return text
    return {"content": text, "tool_calls": [{"name": name, "arguments": arguments} for name, arguments in tool_calls]}


class SessionJudge:
    """Judges the sessions that ended without feedback (see the module docstring)."""

    def __init__(self, judge: Judge, book: SessionBook, after_s: float, clock: Callable[[], float] = time.time) -> None:
        if after_s < 0:
            raise ValueError(f"--judge-after must be 0 or more seconds, not {after_s:g}")
        self.judge, self.book, self.after_s, self.clock = judge, book, after_s, clock
        self._running: set[str] = set()
        self._retry: dict[str, tuple[float, float]] = {}  # session id -> (not before, next backoff)
        self._jobs: set[asyncio.Task[None]] = set()
        self.failures = 0

    def due(self) -> list[LiveSession]:
        """Sessions to judge now: ended ``after_s`` ago or longer, unrewarded, not being judged or waiting to
        be asked again."""
        now = self.clock()
        waiting = self.book.waiting(now - self.after_s)
        ids = {s.row.id for s in waiting}
        for gone in [sid for sid in self._retry if sid not in ids]:  # rewarded or expired meanwhile
            del self._retry[gone]
        return [s for s in waiting if s.row.id not in self._running and self._retry.get(s.row.id, (0.0, 0.0))[0] <= now]

    @staticmethod
    def shown(session: LiveSession) -> tuple[Any, list[Any]]:
        """The task and the candidates the judge reads for ``session``."""
        turns, answers = session.recorder.turns, session.recorder.answers()
        n = session.row.fanout
        if n and len(turns) == n:  # a single-turn fan-out: its candidates side by side
            return turns[0].request_messages, [shown_answer(a) for a in answers[:n]]
        final = [*turns[-1].request_messages, {"role": "assistant", "content": shown_answer(answers[-1])}]
        return turns[0].request_messages, [final]

    def start(self, finish: Callable[[Feedback], Awaitable[None]]) -> int:
        """Start judging every session due now (each a task of its own; the judge limits how many calls run
        at once); how many were started."""
        due = self.due()
        for session in due:
            self._running.add(session.row.id)
            job = asyncio.create_task(self._judge(session, finish))
            self._jobs.add(job)
            job.add_done_callback(self._jobs.discard)
        return len(due)

    async def _judge(self, session: LiveSession, finish: Callable[[Feedback], Awaitable[None]]) -> None:
        sid = session.row.id
        try:
            task, candidates = self.shown(session)
            verdict = await self.judge.judge(task, candidates)
            scores = verdict.scores
            many = len(candidates) > 1
            await finish(Feedback(session=sid, reward=scores[0], candidate_rewards=scores if many else None))
            self._retry.pop(sid, None)
        except FeedbackError as exc:  # its feedback came first and finished it otherwise
            logger.info("gateway: session %s was not judged: %s", sid, exc)
        except JudgeError as exc:
            self.failures += 1
            _, backoff = self._retry.get(sid, (0.0, FIRST_BACKOFF_S))
            self._retry[sid] = (self.clock() + backoff, min(MAX_BACKOFF_S, backoff * 2))
            logger.warning("gateway: judging session %s failed (asked again in %.0f s): %s", sid, backoff, exc)
        except Exception:  # the gateway keeps serving; the session waits for feedback or its TTL
            self.failures += 1
            self._retry[sid] = (self.clock() + MAX_BACKOFF_S, MAX_BACKOFF_S)
            logger.exception("gateway: judging session %s failed", sid)
        finally:
            self._running.discard(sid)

    async def aclose(self) -> None:
        for job in list(self._jobs):
            job.cancel()
        await asyncio.gather(*self._jobs, return_exceptions=True)
        await self.judge.aclose()
