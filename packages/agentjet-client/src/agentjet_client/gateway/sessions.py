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
from typing import Any

from agentjet_client.capture import EpisodeRecorder
from agentjet_client.gateway.journal import Finished, Journal, SessionRow
from agentjet_client.protocol import Feedback, FeedbackResult, Trajectory, Turn

GROUP_BY = ("prompt", "header", "session")


class FeedbackError(ValueError):
    """Feedback that cannot be taken: ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


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
        self.group_size, self.labels, self.group_by = group_size, labels, group_by
        self.task_tag = task_tag
        self.clock = clock
        self._sessions: dict[str, LiveSession] = {}  # gateway id -> session
        self._open_by_key: dict[str, str] = {}  # key -> gateway id of its open session
        self._lock = threading.Lock()
        self._finishing = threading.Lock()  # group membership is read and written by one finish at a time

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

    def note_call(
        self,
        session: LiveSession,
        *,
        response_id: str | None = None,
        response_items: list[Any] | None = None,
        group_key: str | None = None,
        fanout: int | None = None,
        tainted: str | None = None,
    ) -> None:
        """Journal what ``session``'s recorder captured since the last call (before the answer is released)."""
        try:
            self._note(session, response_id, response_items, group_key, fanout, tainted)
        finally:
            with self._lock:
                session.inflight -= 1

    def _note(
        self,
        session: LiveSession,
        response_id: str | None,
        response_items: list[Any] | None,
        group_key: str | None,
        fanout: int | None,
        tainted: str | None,
    ) -> None:
        with session.lock:
            update: dict[str, Any] = {}
            if group_key is not None and session.row.group_key is None:
                session.row.group_key = update["group_key"] = group_key
            if fanout is not None:
                session.row.fanout = update["fanout"] = fanout
            if tainted is not None and session.row.tainted is None:
                session.row.tainted = update["tainted"] = tainted
            entries = session.recorder.entries(session.journaled)
            session.row.last = self.clock()
            self.journal.add_calls(
                session.row.id,
                session.journaled,
                entries,
                session.row.last,
                response_id=response_id,
                response_items=response_items,
                update=update,
                opened=None if session.saved else session.row,
            )
            session.saved = True
            session.journaled += len(entries)

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

    @property
    def live(self) -> int:
        with self._lock:
            return len(self._sessions)

    # ------------------------------------------------------------------ feedback

    def reward_of(self, feedback: Feedback) -> float:
        if feedback.reward is not None:
            return feedback.reward
        assert feedback.label is not None
        if feedback.label not in self.labels:
            known = ", ".join(f"{k}={v:g}" for k, v in sorted(self.labels.items())) or "none"
            raise FeedbackError(
                400, f"unknown label '{feedback.label}' (known: {known}); map it with --label {feedback.label}=REWARD"
            )
        return self.labels[feedback.label]

    def finish(self, feedback: Feedback) -> tuple[FeedbackResult, list[Trajectory]]:
        """The feedback's session rewarded and ended: its trajectories (already in the journal, to be spooled
        by the caller, then ``journal.spooled``). Raises ``FeedbackError`` for feedback it cannot take."""
        reward = self.reward_of(feedback)
        session = self.find(feedback.session)
        if session is None:
            return self._repeated(feedback, reward), []
        with self._finishing, session.lock:
            if session.row.id not in self._sessions:  # another feedback finished it meanwhile
                return self._repeated(feedback, reward), []
            if session.row.tainted is not None:
                self._forget(session)
                self.journal.finish(session.row.id, session.row.key, "fallback", reward=reward)
                return FeedbackResult(session=session.row.id, outcome="fallback", reward=reward), []
            turns = session.recorder.turns
            if not turns:
                raise FeedbackError(409, f"session '{feedback.session}' has made no call that could be trained yet")
            made, dropped, group = self._trajectories(session, turns, feedback, reward)
            self._forget(session)
            self.journal.finish(
                session.row.id,
                session.row.key,
                "trained",
                reward=reward,
                trajectories=made,
                counts={"candidates_dropped": dropped},
                group=group,
            )
        return FeedbackResult(
            session=session.row.id, outcome="trained", reward=reward, trajectories=[t.id for t in made]
        ), made

    def _repeated(self, feedback: Feedback, reward: float) -> FeedbackResult:
        done: Finished | None = self.journal.finished(feedback.session)
        if done is None:
            raise FeedbackError(
                404,
                f"no session '{feedback.session}' on this gateway: give the X-AgentJet-Session (or user) its calls "
                "carried, or the X-AgentJet-Session-Id the gateway answered with",
            )
        if done.outcome == "expired":
            raise FeedbackError(410, f"session '{feedback.session}' expired without a reward (--ttl); it was dropped")
        if done.outcome in ("trained", "fallback") and done.reward != reward:
            raise FeedbackError(
                409, f"session '{feedback.session}' already ended with reward {done.reward:g}; a reward is given once"
            )
        outcome = done.outcome if done.outcome in ("trained", "expired", "opted_out", "fallback") else "trained"
        return FeedbackResult(
            session=done.session,
            outcome=outcome,  # type: ignore[arg-type]
            reward=done.reward,
            trajectories=done.trajectories,
            repeated=True,
        )

    def _trajectories(
        self, session: LiveSession, turns: list[Turn], feedback: Feedback, reward: float
    ) -> tuple[list[Trajectory], int, tuple[str, str, int, int] | None]:
        """The session's trajectories, how many fan-out candidates were dropped, and the group it joined."""
        n = session.row.fanout
        rewards = feedback.candidate_rewards
        if rewards is not None and not n:
            raise FeedbackError(400, "candidate_rewards are for sessions sampled with --fan-out; this one was not")
        if rewards is not None and len(rewards) != n:
            raise FeedbackError(400, f"the session's first call had {n} candidates; candidate_rewards has {len(rewards)}")
        path = [turns[0], *turns[n:]] if n else turns  # the calls the user saw
        bad = [k for k in feedback.turn_rewards or {} if not 0 <= k < len(path)]
        if bad:
            raise FeedbackError(400, f"turn_rewards index {bad[0]} is not a call of this session (it made {len(path)})")
        meta: dict[str, Any] = {"session": session.row.key, "gateway": self.gateway_id}
        if n and len(turns) == n:  # a single-turn fan-out: the candidates are a group of their own
            given = [reward, *(rewards or [])[1:]] if rewards is not None else [reward]
            group_id = f"fanout-{session.row.id}@{self.gateway_id}"
            made = [
                self._trajectory(
                    f"{session.row.id}.{k}", group_id, [turns[k]], value, feedback, {**meta, "candidate": k}, len(given)
                )
                for k, value in enumerate(given)
            ]
            return made, n - len(given), None
        dropped = n - 1 if n else 0
        for index, value in (feedback.turn_rewards or {}).items():
            path[index] = path[index].model_copy(update={"reward": value})
        key = session.row.group_key if self.group_by != "session" else None
        if key is None:
            group_id, group = f"session-{session.row.id}@{self.gateway_id}", None
            size = 1
        else:
            group_id, members, size = self.journal.next_group(key, max(1, self.group_size()), self.gateway_id)
            group = (key, group_id, members, size)
        return [self._trajectory(session.row.id, group_id, path, reward, feedback, meta, size)], dropped, group

    def _trajectory(
        self,
        name: str,
        group_id: str,
        turns: list[Turn],
        reward: float,
        feedback: Feedback,
        meta: dict[str, Any],
        group_size: int,
    ) -> Trajectory:
        return Trajectory(
            id=f"{self.gateway_id}:{name}",
            task_id=group_id,
            task_tag=self.task_tag,
            client_id=self.gateway_id,
            turns=turns,
            reward=reward,
            agent_rewards=feedback.agent_rewards,
            metadata={**meta, "task": group_id.split("@")[0], "group_size": group_size},
        )
