"""The gateway's journal: every live session on disk, call by call, so a killed gateway loses nothing.

One SQLite database (``gateway.db`` in the gateway's ``--spool-dir``, WAL mode). A call's captured turns
are committed here before its answer's last byte leaves the gateway; a session's end, its reward and the
trajectories it became are committed before ``/v1/feedback`` answers. A restarted gateway reads its open
sessions back (``open_sessions``) and spools what was finished but not yet spooled (``unspooled``).

``synchronous=NORMAL``: a commit survives the gateway's process dying (SIGKILL, OOM), not the machine
losing power mid-write; the trajectories themselves go to the spool, which syncs fully.

Tables: ``sessions`` (one row per session not yet finished), ``calls`` (the captured entries of each),
``responses`` (Responses API ids, to follow ``previous_response_id``), ``finished`` (how each session
ended, kept ``KEEP_FINISHED_S`` so a repeated feedback gets the same answer), ``groups`` (the GRPO group
each group key is filling), ``counters``.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentjet_client.delivery.spool import bump, transaction
from agentjet_client.protocol import Trajectory

KEEP_FINISHED_S = 24 * 3600.0
COUNTERS = (
    "sessions",
    "calls",
    "trained",
    "judged",
    "expired",
    "opted_out",
    "fallback",
    "candidates_dropped",
    "untrained_calls",
)


@dataclass
class SessionRow:
    """What the journal keeps of a session besides its calls."""

    id: str
    key: str
    opened: float
    last: float
    ended: float | None = None  # closed, or idle past the gateway's idle timeout: no more calls join it
    group_key: str | None = None
    fanout: int = 0  # candidates sampled for its first call (0: none)
    tainted: str | None = None  # why it cannot be trained (a call answered by the fallback endpoint)


@dataclass
class CallNote:
    """An answered call as the journal keeps it: its captured ``entries`` (numbered from ``first_seq``), the
    session's last activity, the call's Responses id with its conversation so far (``response_items``: what
    a later ``previous_response_id`` stands for), any change to the session's row (``update``: ``group_key``,
    ``fanout``, ``tainted``); with ``opened``, the session's first answered call: its row is written first."""

    session: str
    first_seq: int
    entries: list[dict[str, Any]]
    last: float
    response_id: str | None = None
    response_items: list[Any] | None = None
    update: dict[str, Any] = field(default_factory=dict)
    opened: SessionRow | None = None


@dataclass
class Finished:
    """How a session ended: ``trained`` (rewarded and spooled), ``expired``, ``opted_out``, ``fallback``."""

    session: str
    key: str
    outcome: str
    reward: float | None
    at: float
    trajectories: list[str]  # their ids


class Journal:
    """The gateway's sessions on disk (see the module docstring). Thread-safe; every method commits."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / "gateway.db"
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=10.0)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(
            """
            CREATE TABLE IF NOT EXISTS sessions (
                id TEXT PRIMARY KEY, key TEXT NOT NULL, opened REAL NOT NULL, last REAL NOT NULL,
                ended REAL, group_key TEXT, fanout INTEGER NOT NULL DEFAULT 0, tainted TEXT
            );
            CREATE INDEX IF NOT EXISTS sessions_by_key ON sessions (key);
            CREATE TABLE IF NOT EXISTS calls (
                session TEXT NOT NULL, seq INTEGER NOT NULL, entry TEXT NOT NULL, PRIMARY KEY (session, seq)
            );
            CREATE TABLE IF NOT EXISTS responses (response_id TEXT PRIMARY KEY, session TEXT NOT NULL, items TEXT);
            CREATE TABLE IF NOT EXISTS finished (
                session TEXT PRIMARY KEY, key TEXT NOT NULL, outcome TEXT NOT NULL, reward REAL, at REAL NOT NULL,
                ids TEXT NOT NULL, body TEXT
            );
            CREATE INDEX IF NOT EXISTS finished_by_key ON finished (key);
            CREATE TABLE IF NOT EXISTS groups (
                key TEXT PRIMARY KEY, group_id TEXT NOT NULL, members INTEGER NOT NULL, size INTEGER NOT NULL
            );
            CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
            CREATE TABLE IF NOT EXISTS notes (name TEXT PRIMARY KEY, value TEXT NOT NULL);
            """
        )
        self._lock = threading.Lock()

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        with self._lock, transaction(self._db) as db:
            yield db

    # ------------------------------------------------------------------ identity

    def gateway_id(self) -> str:
        """This journal's gateway id (made once, kept across restarts: trajectory ids and group ids use it)."""
        with self._write() as db:
            row = db.execute("SELECT value FROM notes WHERE name = 'gateway_id'").fetchone()
            if row is not None:
                return str(row[0])
            made = f"gw-{uuid.uuid4().hex[:10]}"
            db.execute("INSERT INTO notes (name, value) VALUES ('gateway_id', ?)", (made,))
            return made

    # ------------------------------------------------------------------ sessions

    def _insert_session(self, db: sqlite3.Connection, row: SessionRow) -> None:
        db.execute(
            "INSERT INTO sessions (id, key, opened, last, ended, group_key, fanout, tainted)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (row.id, row.key, row.opened, row.last, row.ended, row.group_key, row.fanout, row.tainted),
        )
        bump(db, "sessions")

    def add_calls(self, notes: list[CallNote]) -> None:
        """Append answered calls (``CallNote``), all in one transaction."""
        for note in notes:
            if set(note.update) - {"group_key", "fanout", "tainted", "ended"}:
                raise ValueError(f"not a session column: {sorted(note.update)}")
        with self._write() as db:
            for note in notes:
                if note.opened is not None:
                    self._insert_session(db, note.opened)
                db.executemany(
                    "INSERT OR REPLACE INTO calls (session, seq, entry) VALUES (?, ?, ?)",
                    [(note.session, note.first_seq + k, json.dumps(entry)) for k, entry in enumerate(note.entries)],
                )
                changes = {"last": note.last, **note.update}
                db.execute(
                    f"UPDATE sessions SET {', '.join(f'{name} = ?' for name in changes)} WHERE id = ?",
                    (*changes.values(), note.session),
                )
                if note.response_id is not None:
                    db.execute(
                        "INSERT OR REPLACE INTO responses (response_id, session, items) VALUES (?, ?, ?)",
                        (note.response_id, note.session, json.dumps(note.response_items or [])),
                    )
            bump(db, "calls", len(notes))

    def end_session(self, session: str, at: float) -> None:
        """No more calls join ``session``; it waits for its reward."""
        with self._write() as db:
            db.execute("UPDATE sessions SET ended = COALESCE(ended, ?) WHERE id = ?", (at, session))

    def open_sessions(self) -> list[tuple[SessionRow, list[dict[str, Any]]]]:
        """Every session not yet finished, with its call entries in order (a restarted gateway's state)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT id, key, opened, last, ended, group_key, fanout, tainted FROM sessions ORDER BY opened"
            ).fetchall()
            calls: dict[str, list[dict[str, Any]]] = {}
            for session, entry in self._db.execute("SELECT session, entry FROM calls ORDER BY session, seq"):
                calls.setdefault(session, []).append(json.loads(entry))
        return [(SessionRow(*row), calls.get(row[0], [])) for row in rows]

    def session_of_response(self, response_id: str) -> str | None:
        with self._lock:
            row = self._db.execute("SELECT session FROM responses WHERE response_id = ?", (response_id,)).fetchone()
        return None if row is None else str(row[0])

    def response_items(self, response_id: str) -> list[Any] | None:
        """The conversation a Responses id stands for (its input items and its output), if the gateway made it."""
        with self._lock:
            row = self._db.execute("SELECT items FROM responses WHERE response_id = ?", (response_id,)).fetchone()
        return None if row is None else list(json.loads(row[0] or "[]"))

    # ------------------------------------------------------------------ endings

    def finish(
        self,
        session: str,
        key: str,
        outcome: str,
        *,
        reward: float | None = None,
        trajectories: list[Trajectory] | None = None,
        counts: dict[str, int] | None = None,
        group: tuple[str, str, int, int] | None = None,
        now: float | None = None,
    ) -> None:
        """End ``session`` for good: its rows go, how it ended stays (with its ``trajectories`` until
        ``spooled``), ``outcome`` and ``counts`` are counted, the group it joined (``group``: key, group id,
        members, size; from ``next_group``) is noted; one transaction."""
        made = trajectories or []
        with self._write() as db:
            db.execute("DELETE FROM sessions WHERE id = ?", (session,))
            db.execute("DELETE FROM calls WHERE session = ?", (session,))
            db.execute("DELETE FROM responses WHERE session = ?", (session,))
            body = json.dumps([t.model_dump(mode="json") for t in made]) if made else None
            db.execute(
                "INSERT OR REPLACE INTO finished (session, key, outcome, reward, at, ids, body)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (session, key, outcome, reward, now or time.time(), json.dumps([t.id for t in made]), body),
            )
            bump(db, outcome)
            for name, by in (counts or {}).items():
                if by:
                    bump(db, name, by)
            if group is not None:
                db.execute("INSERT OR REPLACE INTO groups (key, group_id, members, size) VALUES (?, ?, ?, ?)", group)

    def spooled(self, session: str) -> None:
        """``session``'s trajectories are in the spool: the journal's copy goes."""
        with self._write() as db:
            db.execute("UPDATE finished SET body = NULL WHERE session = ?", (session,))

    def unspooled(self) -> list[tuple[str, list[Trajectory]]]:
        """Finished sessions whose trajectories may not have reached the spool (killed in between)."""
        with self._lock:
            rows = self._db.execute("SELECT session, body FROM finished WHERE body IS NOT NULL").fetchall()
        return [(session, [Trajectory.model_validate(t) for t in json.loads(body)]) for session, body in rows]

    def finished(self, session_or_key: str) -> Finished | None:
        """How the session of this id (or the newest of this key) ended, if it has."""
        with self._lock:
            row = self._db.execute(
                "SELECT session, key, outcome, reward, at, ids FROM finished WHERE session = ?"
                " UNION ALL SELECT * FROM (SELECT session, key, outcome, reward, at, ids FROM finished"
                " WHERE key = ? ORDER BY at DESC LIMIT 1) LIMIT 1",
                (session_or_key, session_or_key),
            ).fetchone()
        if row is None:
            return None
        return Finished(row[0], row[1], row[2], row[3], row[4], json.loads(row[5]))

    def forget_finished(self, before: float) -> int:
        """Drop the records of sessions finished before ``before`` (already spooled)."""
        with self._write() as db:
            return int(db.execute("DELETE FROM finished WHERE at < ? AND body IS NULL", (before,)).rowcount)

    # ------------------------------------------------------------------ groups

    def next_group(self, key: str, size: int, gateway_id: str) -> tuple[str, int, int]:
        """The GRPO group the next finished session of group key ``key`` joins: (its id, the members it
        will have with that session, its size). The one filling until it holds its size, else a new one of
        ``size``. ``finish(group=...)`` records the joining (callers serialise the two)."""
        with self._lock:
            row = self._db.execute("SELECT group_id, members, size FROM groups WHERE key = ?", (key,)).fetchone()
        if row is None or row[1] >= row[2]:
            return f"{key}@{gateway_id}:{uuid.uuid4().hex[:8]}", 1, size
        return str(row[0]), int(row[1]) + 1, int(row[2])

    # ------------------------------------------------------------------ counts

    def counts(self) -> dict[str, int]:
        with self._lock:
            rows = dict(self._db.execute("SELECT name, value FROM counters").fetchall())
            waiting = self._db.execute("SELECT COUNT(*) FROM sessions WHERE ended IS NOT NULL").fetchone()[0]
            live = self._db.execute("SELECT COUNT(*) FROM sessions WHERE ended IS NULL").fetchone()[0]
        return {**{name: int(rows.get(name, 0)) for name in COUNTERS}, "open": int(live), "waiting": int(waiting)}

    def count(self, name: str, by: int = 1) -> None:
        with self._write() as db:
            bump(db, name, by)

    def close(self) -> None:
        with self._lock:
            self._db.close()
