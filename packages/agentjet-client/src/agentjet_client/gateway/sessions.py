"""Live sessions: which session a call belongs to, what it captured, and the episodes it becomes.

A session is found by its key: the ``X-AgentJet-Session`` header, else the request's ``user`` (Messages:
``metadata.user_id``), else the session of the Responses ``previous_response_id`` it continues; a call
with none of these is a session of its own. A session is open until it is closed, gets its feedback, or
sees no call for ``idle_s`` seconds; a call with the key of an ended session opens a new one. An ended
session waits for its reward until ``ttl_s`` seconds after its last call, then expires (dropped, counted,
never trained).

Feedback turns the session into trajectories (``finish``): one episode with every call's turns, merged
into timelines by the server as for ``run``; its GRPO group is the group key's group being filled (by
default the hash of the session's first request, so sessions that opened with the same prompt are
siblings; ``X-AgentJet-Group`` names one). With ``--fan-out N`` the first call was sampled N times: a
session that stayed single-turn becomes N one-turn episodes of their own group, each rewarded by its
``candidate_rewards`` entry (the first by the session's reward); the candidates without one are dropped.
A fan-out session that went on past its first call trains only the path the user saw.

Every step is committed to the ``Journal`` before it is acknowledged.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from agentjet_client.capture.recorder import EpisodeRecorder
from agentjet_client.delivery.spool import GroupCommit
from agentjet_client.gateway.episodes import GROUP_BY, Episodes, FeedbackError
from agentjet_client.gateway.journal import CallNote, Journal, SessionRow
from agentjet_client.protocol import Feedback, FeedbackResult, Trajectory


class _Answered(NamedTuple):
    """A call answered and waiting for its journal commit (``SessionBook.note_call``)."""

    session: LiveSession
    response_id: str | None
    response_items: list[Any] | None
    group_key: str | None
    fanout: int | None
    tainted: str | None


@dataclass
class LiveSession:
    row: SessionRow
    recorder: EpisodeRecorder = field(default_factory=EpisodeRecorder)
    journaled: int = 0  # entries of ``recorder`` already in the journal
    saved: bool = False  # in the journal: a call of it was answered
    inflight: int = 0  # its calls being answered now
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def open(self) -> bool:
        return self.row.ended is None


def prompt_key(agent: str, chat: dict[str, Any]) -> str:
    """The default group key of a session: what its first call showed the model."""
    shown = {"agent": agent, "messages": chat.get("messages"), "tools": chat.get("tools") or []}
    digest = hashlib.sha256(json.dumps(shown, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return f"prompt-{digest}"


class SessionBook:
    """The gateway's live sessions, kept in memory and in the ``Journal`` (see the module docstring)."""

    def __init__(
        self,
        journal: Journal,
        *,
        idle_s: float,
        ttl_s: float,
        group_size: Callable[[], int],
        labels: dict[str, float],
        group_by: str = "prompt",
        task_tag: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if group_by not in GROUP_BY:
            raise ValueError(f"group_by must be one of {', '.join(GROUP_BY)}, not {group_by!r}")
        self.journal = journal
        self.gateway_id = journal.gateway_id()
        self.idle_s, self.ttl_s = idle_s, ttl_s
        self.group_by = group_by
        self.episodes = Episodes(journal, self.gateway_id, group_size, labels, group_by, task_tag)
        self.clock = clock
        self._sessions: dict[str, LiveSession] = {}  # gateway id -> session
        self._open_by_key: dict[str, str] = {}  # key -> gateway id of its open session
        self._lock = threading.Lock()
        self._finishing = threading.Lock()  # group membership is read and written by one finish at a time
        self._notes: GroupCommit[_Answered, None] = GroupCommit(self._journal_calls)

    # ------------------------------------------------------------------ sessions

    def restore(self) -> int:
        """Read back the sessions a killed gateway left open or waiting; how many."""
        for row, entries in self.journal.open_sessions():
            session = LiveSession(row, saved=True)
            session.recorder.restore(entries)
            session.journaled = len(entries)
            self._sessions[row.id] = session
            if row.ended is None:
                self._open_by_key[row.key] = row.id
        return len(self._sessions)

    def find(self, session_or_key: str) -> LiveSession | None:
        """The session of this gateway id, else the newest unfinished one of this key."""
        with self._lock:
            if session_or_key in self._sessions:
                return self._sessions[session_or_key]
            found = self._open_by_key.get(session_or_key)
            if found is not None:
                return self._sessions[found]
            waiting = [s for s in self._sessions.values() if s.row.key == session_or_key]
        return max(waiting, key=lambda s: s.row.last) if waiting else None

    def session_for(self, key: str | None, previous_response_id: str | None) -> tuple[LiveSession, bool]:
        """The open session a call of ``key`` (or continuing ``previous_response_id``) belongs to, opened if
        there is none; and whether it was opened now. A new session reaches the journal with its first
        answered call (``note_call``); every call taken here ends in ``note_call`` or ``release``."""
        now = self.clock()
        earlier = self.journal.session_of_response(previous_response_id) if previous_response_id else None
        with self._lock:
            found: LiveSession | None = None
            if key is None and earlier is not None and earlier in self._sessions and self._sessions[earlier].open:
                found = self._sessions[earlier]
            elif key is not None and key in self._open_by_key:
                found = self._sessions[self._open_by_key[key]]
            if found is not None:
                found.inflight += 1
                return found, False
            made = uuid.uuid4().hex
            session = LiveSession(SessionRow(id=made, key=key or made, opened=now, last=now), inflight=1)
            self._sessions[made] = session
            self._open_by_key[session.row.key] = made
        return session, True

    def release(self, session: LiveSession) -> None:
        """A call of ``session`` ended unanswered: a session none of whose calls was answered is forgotten."""
        with self._lock:
            session.inflight -= 1
            gone = not session.saved and session.inflight == 0
        if gone:
            self._forget(session)

    async def note_call(
        self,
        session: LiveSession,
        *,
        response_id: str | None = None,
        response_items: list[Any] | None = None,
        group_key: str | None = None,
        fanout: int | None = None,
        tainted: str | None = None,
    ) -> None:
        """Journal what ``session``'s recorder captured since its last journaled call (before the answer is
        released). Calls answered together are journaled together: one worker-thread hop and one transaction."""
        try:
            await self._notes.put(_Answered(session, response_id, response_items, group_key, fanout, tainted))
        finally:
            with self._lock:
                session.inflight -= 1

    def _journal_calls(self, answered: list[_Answered]) -> list[None]:
        """(a worker thread) One transaction for the calls in ``answered``. A session's entries are written from
        what it has journaled to what it has recorded: a second call of it in the same group writes the same
        rows again (keyed by sequence number, so nothing doubles)."""
        notes: list[CallNote] = []
        opened: set[str] = set()
        for call in answered:
            session = call.session
            with session.lock:
                update: dict[str, Any] = {}
                if call.group_key is not None and session.row.group_key is None:
                    session.row.group_key = update["group_key"] = call.group_key
                if call.fanout is not None:
                    session.row.fanout = update["fanout"] = call.fanout
                if call.tainted is not None and session.row.tainted is None:
                    session.row.tainted = update["tainted"] = call.tainted
                session.row.last = self.clock()
                written = session.saved or session.row.id in opened
                opened.add(session.row.id)
                notes.append(
                    CallNote(
                        session.row.id,
                        session.journaled,
                        session.recorder.entries(session.journaled),
                        session.row.last,
                        response_id=call.response_id,
                        response_items=call.response_items,
                        update=update,
                        opened=None if written else session.row,
                    )
                )
        self.journal.add_calls(notes)
        for call, note in zip(answered, notes, strict=True):
            with call.session.lock:
                call.session.saved = True
                call.session.journaled = max(call.session.journaled, note.first_seq + len(note.entries))
        return [None] * len(answered)

    def end(self, session: LiveSession) -> None:
        """No more calls join ``session``; it waits for its reward."""
        with self._lock:
            if session.row.ended is not None:
                return
            session.row.ended = self.clock()
            if self._open_by_key.get(session.row.key) == session.row.id:
                del self._open_by_key[session.row.key]
        self.journal.end_session(session.row.id, session.row.ended)

    def drop(self, session: LiveSession, outcome: str) -> None:
        """Finish ``session`` untrained (``opted_out``, ``expired``)."""
        self._forget(session)
        if session.saved:
            self.journal.finish(session.row.id, session.row.key, outcome)

    def _forget(self, session: LiveSession) -> None:
        with self._lock:
            self._sessions.pop(session.row.id, None)
            if self._open_by_key.get(session.row.key) == session.row.id:
                del self._open_by_key[session.row.key]

    def sweep(self) -> tuple[int, int]:
        """End sessions idle for ``idle_s``, expire those unrewarded ``ttl_s`` after their last call; how many
        of each."""
        now = self.clock()
        with self._lock:
            sessions = list(self._sessions.values())
        ended = expired = 0
        for session in sessions:
            if session.inflight or not session.saved:  # a call is being answered: not idle
                continue
            if now - session.row.last >= self.ttl_s:
                self.drop(session, "expired")
                expired += 1
            elif session.open and now - session.row.last >= self.idle_s:
                self.end(session)
                ended += 1
        return ended, expired

    def waiting(self, ended_before: float) -> list[LiveSession]:
        """Sessions that ended at or before ``ended_before`` and wait for their reward, with calls that can be
        trained (for a judge)."""
        with self._lock:
            sessions = list(self._sessions.values())
        return [
            s
            for s in sessions
            if s.row.ended is not None and s.row.ended <= ended_before and s.saved and s.row.tainted is None
        ]

    @property
    def live(self) -> int:
        with self._lock:
            return len(self._sessions)

    # ------------------------------------------------------------------ feedback

    def finish(self, feedback: Feedback, judged: bool = False) -> tuple[FeedbackResult, list[Trajectory]]:
        """The feedback's session rewarded and ended: its trajectories (already in the journal, to be spooled
        by the caller, then ``journal.spooled``); ``judged``: the reward is a judge's. Raises ``FeedbackError``
        for feedback it cannot take."""
        reward = self.episodes.reward_of(feedback)
        session = self.find(feedback.session)
        if session is None:
            return self.episodes.repeated(feedback, reward), []
        with self._finishing, session.lock:
            if session.row.id not in self._sessions:  # another feedback finished it meanwhile
                return self.episodes.repeated(feedback, reward), []
            if session.row.tainted is not None:
                self._forget(session)
                self.journal.finish(session.row.id, session.row.key, "fallback", reward=reward)
                return FeedbackResult(session=session.row.id, outcome="fallback", reward=reward), []
            turns = session.recorder.turns
            if not turns:
                raise FeedbackError(409, f"session '{feedback.session}' has made no call that could be trained yet")
            made, dropped, group = self.episodes.build(session.row, turns, feedback, reward)
            self._forget(session)
            self.journal.finish(
                session.row.id,
                session.row.key,
                "trained",
                reward=reward,
                trajectories=made,
                counts={"candidates_dropped": dropped, "judged": int(judged)},
                group=group,
            )
        return FeedbackResult(
            session=session.row.id, outcome="trained", reward=reward, trajectories=[t.id for t in made]
        ), made
