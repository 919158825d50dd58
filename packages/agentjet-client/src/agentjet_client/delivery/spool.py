"""The client's durable outbox: finished trajectories on local disk until the server has answered.

A ``Spool`` is one SQLite database in WAL mode (``spool.db`` under ``--spool-dir``). The runner
``put``s each finished trajectory — the call returns once it is committed with
``synchronous=FULL``, so a crash after ``put`` loses nothing — and a background sender ``peek``s
the oldest ones, pushes them, and ``settle``s those the server answered (accepted, duplicate or
rejected: each is an answer, so the item leaves the spool and the answer is counted). An item the
server never answered stays, and is sent again after a restart; the server's exactly-once
ingestion reports such a resend as ``duplicate``.

Several processes may share a spool (two runs on one machine against one server use the same default
directory). Each item belongs to the ``Spool`` that put it (its ``owner``), and only its owner sends it,
so every run hears the answers to its own trajectories. An open ``Spool`` holds an OS lock on
``owners/<its token>.lock``; items whose owner closed or died (the lock is free) are adopted by the
next ``Spool`` that looks, and sent by it.

Size bound: ``max_items`` (default 100,000). A full spool never drops anything; the runner stops
starting episodes while ``full`` is true, and says so once in the log, until the sender has made
room. Episodes already running still land in the spool (so it can pass the bound by at most the
runner's concurrency).

    spool = Spool(Path("~/.local/share/agentjet/spool").expanduser())
    spool.put(trajectory)
    for item_id, trajectory in spool.peek(256): ...
    spool.settle({item_id: "accepted"})
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

from filelock import FileLock, Timeout

from agentjet_client.errors import AgentJetError
from agentjet_client.protocol import Trajectory

T = TypeVar("T")
R = TypeVar("R")

DEFAULT_MAX_ITEMS = 100_000
_COUNTERS = ("spooled", "sent", "accepted", "duplicate", "rejected")


@contextlib.contextmanager
def transaction(db: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """One write transaction on ``db`` (opened with ``isolation_level=None``): taken at once (``BEGIN
    IMMEDIATE``: a writer never fails half-way on a lock), committed on success, rolled back on any error.
    The spool and the gateway's journal write through it."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield db
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


def bump(db: sqlite3.Connection, name: str, by: int = 1) -> None:
    """Add ``by`` to counter ``name`` of a ``counters (name, value)`` table."""
    db.execute(
        "INSERT INTO counters (name, value) VALUES (?, ?) ON CONFLICT(name) DO UPDATE SET value = value + ?",
        (name, by, by),
    )


class SpoolError(AgentJetError):
    """The spool's database cannot be opened or written."""


@dataclass(frozen=True)
class SpoolStats:
    depth: int
    spooled: int
    sent: int
    accepted: int
    duplicate: int
    rejected: int
    last_error: str | None
    max_items: int

    def summary(self) -> str:
        line = (
            f"spool depth {self.depth}/{self.max_items}  spooled {self.spooled}  sent {self.sent}  "
            f"accepted {self.accepted}  duplicate {self.duplicate}  rejected {self.rejected}"
        )
        return line + (f"  last error: {self.last_error}" if self.last_error else "")


def default_spool_dir() -> Path:
    """Where a user's spool lives unless ``--spool-dir`` says otherwise (XDG data dir)."""
    import os

    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "agentjet" / "spool"


def spool_key(server_url: str) -> str:
    """One spool per server: a directory name from its URL (``127.0.0.1_8000``)."""
    from urllib.parse import urlsplit

    parts = urlsplit(server_url)
    name = f"{parts.hostname or 'server'}_{parts.port or (443 if parts.scheme == 'https' else 80)}{parts.path}"
    return "".join(c if c.isalnum() or c in "-._" else "_" for c in name).strip("_")


LOCK_WAIT_S = 10.0
SET_ASIDE = "set-aside"  # spools of earlier server runs, under a spool directory: <dir>/set-aside/<run id>/


def open_for_run(directory: Path, run_id: str | None, *, max_items: int = DEFAULT_MAX_ITEMS) -> tuple[Spool, int]:
    """The spool in ``directory`` bound to the server run ``run_id``, and how many items it set aside:
    items an earlier run left for *another* run of the server (its state dir started afresh, or another
    server on the same address) were sampled by a policy this server never served, so they are moved to
    ``<directory>/set-aside/<their run id>/`` instead of being sent (and rejected)."""
    spool = Spool(directory, max_items=max_items)
    earlier, depth = spool.server_run, spool.depth
    if run_id is None or earlier is None or earlier == run_id or depth == 0:
        spool.bind(run_id)
        return spool, 0
    spool.close()
    aside = directory / SET_ASIDE / earlier
    aside.mkdir(parents=True, exist_ok=True)
    for name in ("spool.db", "spool.db-wal", "spool.db-shm"):
        if (directory / name).exists():
            os.replace(directory / name, aside / name)
    spool = Spool(directory, max_items=max_items)
    spool.bind(run_id)
    return spool, depth


_INSERT = "INSERT OR IGNORE INTO items (id, body, added, pending, owner) VALUES (?, ?, ?, ?, ?)"
OWNERS = "owners"  # <spool dir>/owners/<token>.lock: locked while that Spool is open
ADOPT_EVERY_S = 2.0  # how often a spool looks for items whose owner is gone
WAITING = "agentjet_waiting_for"  # metadata key of a trajectory whose reward a judge has still to give


def _pending(trajectory: Trajectory) -> int:
    return 1 if trajectory.metadata.get(WAITING) else 0


def _locked(exc: BaseException) -> bool:
    return isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc)


def _connect(path: Path) -> sqlite3.Connection:
    """Open the spool database in WAL mode, waiting out another process that is creating it.

    Switching a new database to WAL takes an exclusive lock that SQLite's busy handler does not
    wait for, so a reader (``agentjet-client status``, a second runner) that opens the file while
    the first runner is still initialising it gets "database is locked" at once: retry for a while.
    """
    deadline = time.monotonic() + LOCK_WAIT_S
    db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=LOCK_WAIT_S)
    try:
        while True:
            try:
                if db.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
                    db.execute("PRAGMA journal_mode=WAL")
                break
            except sqlite3.OperationalError as exc:
                if not _locked(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        db.execute("PRAGMA synchronous=FULL")
        db.execute(f"PRAGMA busy_timeout={int(LOCK_WAIT_S * 1000)}")
    except BaseException:
        db.close()
        raise
    return db


def _owner_alive(directory: Path, token: str) -> bool:
    """Whether the spool ``token`` of ``directory`` is open in some process (it holds its owner lock)."""
    path = directory / OWNERS / f"{token}.lock"
    if not path.exists():
        return False
    lock = FileLock(path)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        return True
    lock.release()
    path.unlink(missing_ok=True)
    return False


class _TaskOrders:
    """Where a run's task order stands, kept in the spool's database so that the next run goes on from it
    (``taskorder``): each track's order (fingerprint, seed, next position) and its groups still open."""

    _db: sqlite3.Connection
    _lock: threading.Lock
    _write: Callable[[], contextlib.AbstractContextManager[sqlite3.Connection]]

    def task_order(self, track: str) -> tuple[str, int, int] | None:
        """``(fingerprint, seed, next position)`` of ``track``'s task order, as the last run left it."""
        with self._lock:
            row = self._db.execute("SELECT fingerprint, seed, next FROM task_orders WHERE track = ?", (track,))
            found = row.fetchone()
        return (str(found[0]), int(found[1]), int(found[2])) if found else None

    def start_task_order(self, track: str, fingerprint: str, seed: int) -> None:
        """Begin ``track``'s order afresh (its groups left open by an earlier run are forgotten)."""
        with self._lock, self._write() as db:
            db.execute("DELETE FROM task_groups WHERE track = ?", (track,))
            db.execute(
                "INSERT OR REPLACE INTO task_orders (track, fingerprint, seed, next) VALUES (?, ?, ?, 0)",
                (track, fingerprint, seed),
            )

    def open_group(self, track: str, position: int, group_id: str, task_id: str, size: int) -> None:
        """Note that the group of ``position`` starts (``size`` episodes): it stays open until that many of its
        trajectories are spooled (counted in the same transaction that commits each)."""
        with self._lock, self._write() as db:
            db.execute(
                "INSERT OR IGNORE INTO task_groups (group_id, track, position, task_id, size) VALUES (?, ?, ?, ?, ?)",
                (group_id, track, position, task_id, size),
            )
            db.execute("UPDATE task_orders SET next = MAX(next, ?) WHERE track = ?", (position + 1, track))

    def pass_over(self, track: str, position: int) -> None:
        """Note that ``position`` of ``track``'s order was passed over (dynamic sampling): no group there."""
        with self._lock, self._write() as db:
            db.execute("UPDATE task_orders SET next = MAX(next, ?) WHERE track = ?", (position + 1, track))

    def open_groups(self, track: str) -> list[tuple[int, str, str, int]]:
        """``(position, group id, task id, episodes missing)`` of ``track``'s groups an earlier run started
        and did not spool in full, oldest first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT position, group_id, task_id, size - spooled FROM task_groups WHERE track = ? ORDER BY position",
                (track,),
            ).fetchall()
        return [(int(p), str(g), str(t), int(n)) for p, g, t, n in rows]


class Spool(_TaskOrders):
    """The durable outbox of one server: trajectories are fsynced here before a run moves on, and
    leave only once the server answered them (at most ``max_items`` waiting; then new episodes wait)."""

    def __init__(self, directory: Path, *, max_items: int = DEFAULT_MAX_ITEMS) -> None:
        if max_items < 1:
            raise ValueError("max_items must be at least 1")
        self.directory = Path(directory)
        self.max_items = max_items
        self.unreadable: list[tuple[str, str]] = []  # (id, why) of items the last peek could not read
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._db = _connect(self.directory / "spool.db")
            self._db.executescript(
                """
                CREATE TABLE IF NOT EXISTS items (
                    seq INTEGER PRIMARY KEY AUTOINCREMENT,
                    id TEXT NOT NULL UNIQUE,
                    body TEXT NOT NULL,
                    added REAL NOT NULL,
                    attempts INTEGER NOT NULL DEFAULT 0,
                    pending INTEGER NOT NULL DEFAULT 0,
                    owner TEXT
                );
                CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
                CREATE TABLE IF NOT EXISTS notes (name TEXT PRIMARY KEY, value TEXT);
                CREATE TABLE IF NOT EXISTS judged (key TEXT PRIMARY KEY, value TEXT NOT NULL);
                CREATE TABLE IF NOT EXISTS task_orders (
                    track TEXT PRIMARY KEY, fingerprint TEXT NOT NULL, seed INTEGER NOT NULL, next INTEGER NOT NULL
                );
                CREATE TABLE IF NOT EXISTS task_groups (
                    group_id TEXT PRIMARY KEY, track TEXT NOT NULL, position INTEGER NOT NULL,
                    task_id TEXT NOT NULL, size INTEGER NOT NULL, spooled INTEGER NOT NULL DEFAULT 0
                );
                """
            )
            columns = {row[1] for row in self._db.execute("PRAGMA table_info(items)")}
            # a spool of an earlier version: its items wait for nothing, and belong to whoever opens it
            for column in ("pending INTEGER NOT NULL DEFAULT 0", "owner TEXT"):
                if column.split()[0] not in columns:
                    try:
                        self._db.execute(f"ALTER TABLE items ADD COLUMN {column}")
                    except sqlite3.OperationalError as exc:  # another process opening it added it first
                        if "duplicate column" not in str(exc):
                            raise
            self.token = uuid.uuid4().hex
            (self.directory / OWNERS).mkdir(exist_ok=True)
            # released by whichever thread closes the spool
            self._owner = FileLock(self.directory / OWNERS / f"{self.token}.lock", thread_local=False)
            self._owner.acquire(timeout=0)
        except (OSError, sqlite3.Error) as exc:
            hint = (
                "another process holds it locked for longer than "
                f"{LOCK_WAIT_S:.0f} s; stop it or pass another --spool-dir"
                if _locked(exc)
                else "pass --spool-dir a writable directory"
            )
            raise SpoolError(f"cannot open the spool in {self.directory}: {exc} ({hint})") from exc
        self._lock = threading.Lock()
        self._adopted_at = 0.0

    # ------------------------------------------------------------------ owners

    def _adopt(self) -> None:
        """Make this spool the owner of items whose owner is gone (closed, crashed, or of an earlier version);
        at most every ``ADOPT_EVERY_S``. Called with ``_lock`` held."""
        if time.monotonic() - self._adopted_at < ADOPT_EVERY_S:
            return
        self._adopted_at = time.monotonic()
        others = self._db.execute("SELECT DISTINCT owner FROM items WHERE owner IS NOT ?", (self.token,)).fetchall()
        gone = [owner for (owner,) in others if owner is None or not _owner_alive(self.directory, owner)]
        if not gone:
            return
        with self._write() as db:
            named = [owner for owner in gone if owner is not None]
            db.execute(
                f"UPDATE items SET owner = ? WHERE owner IS NULL OR owner IN ({','.join('?' * len(named))})",
                [self.token, *named],
            )

    # ------------------------------------------------------------------ writing

    def put(self, trajectory: Trajectory) -> bool:
        """Commit a finished trajectory to disk. False if one with this id is already spooled."""
        row = (trajectory.id, trajectory.model_dump_json(), time.time(), _pending(trajectory), self.token)
        with self._lock, self._write() as db:
            inserted = db.execute(_INSERT, row).rowcount
            if inserted:
                bump(db, "spooled", 1)
                self._count_in_group(db, trajectory.task_id)
        return bool(inserted)

    def put_many(self, trajectories: list[Trajectory]) -> list[bool]:
        """Commit several trajectories in one transaction (one fsync): ``put`` for each, grouped."""
        rows = [(t.id, t.model_dump_json(), time.time(), _pending(t), self.token) for t in trajectories]
        inserted = []
        with self._lock, self._write() as db:
            for row, trajectory in zip(rows, trajectories, strict=True):
                inserted.append(bool(db.execute(_INSERT, row).rowcount))
                if inserted[-1]:
                    self._count_in_group(db, trajectory.task_id)
            if any(inserted):
                bump(db, "spooled", sum(inserted))
        return inserted

    def peek(self, limit: int = 256) -> list[tuple[str, Trajectory]]:
        """The oldest ``limit`` items of this spool's (see ``_adopt``) ready to send (not waiting for a judge)."""
        with self._lock:
            self._adopt()
            rows = self._db.execute(
                "SELECT id, body FROM items WHERE pending = 0 AND owner = ? ORDER BY seq LIMIT ?", (self.token, limit)
            ).fetchall()
        items, self.unreadable = [], []
        for item_id, body in rows:
            try:
                items.append((item_id, Trajectory.model_validate_json(body)))
            except ValueError as exc:  # no server would take it: the sender settles it as rejected
                self.unreadable.append((item_id, str(exc).splitlines()[0]))
        return items

    def waiting(self, ids: list[str] | None = None) -> list[tuple[Trajectory, float]]:
        """The items (of ``ids``; else this spool's) waiting for their judge (``judging``), oldest first, with
        when each was spooled."""
        query, args = "SELECT body, added FROM items WHERE pending = 1", list(ids or [])
        if ids is not None:
            query += f" AND id IN ({','.join('?' * len(args))})"
        else:
            query, args = query + " AND owner = ?", [self.token]
        with self._lock:
            if ids is None:
                self._adopt()
            rows = self._db.execute(query + " ORDER BY seq", args).fetchall()
        return [(Trajectory.model_validate_json(body), float(added)) for body, added in rows]

    def release(self, judged: list[Trajectory]) -> int:
        """Replace waiting items by their judged versions (same ids), ready to send; how many were waiting."""
        with self._lock, self._write() as db:
            return sum(
                db.execute(
                    "UPDATE items SET body = ?, pending = 0 WHERE id = ? AND pending = 1",
                    (t.model_dump_json(), t.id),
                ).rowcount
                for t in judged
            )

    def judged(self, key: str) -> str | None:
        """A judge's answer kept under ``key`` (the judge and what it judged), if one was."""
        with self._lock:
            row = self._db.execute("SELECT value FROM judged WHERE key = ?", (key,)).fetchone()
        return str(row[0]) if row else None

    def keep_judged(self, key: str, value: str) -> None:
        with self._lock, self._write() as db:
            db.execute("INSERT OR REPLACE INTO judged (key, value) VALUES (?, ?)", (key, value))

    def mark_sent(self, ids: list[str]) -> None:
        with self._lock, self._write() as db:
            db.executemany("UPDATE items SET attempts = attempts + 1 WHERE id = ?", [(i,) for i in ids])
            bump(db, "sent", len(ids))

    def settle(self, answers: Mapping[str, str]) -> None:
        """Remove items the server answered; ``answers`` maps id to accepted/duplicate/rejected."""
        with self._lock, self._write() as db:
            for item_id, status in answers.items():
                if db.execute("DELETE FROM items WHERE id = ?", (item_id,)).rowcount:
                    bump(db, status if status in _COUNTERS else "rejected", 1)

    def note_error(self, message: str | None) -> None:
        with self._lock, self._write() as db:
            db.execute("INSERT OR REPLACE INTO notes (name, value) VALUES ('last_error', ?)", (message,))

    # ------------------------------------------------------------------ reading

    @property
    def depth(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM items").fetchone()[0])

    @property
    def full(self) -> bool:
        return self.depth >= self.max_items

    def stats(self) -> SpoolStats:
        with self._lock:
            counts = dict(self._db.execute("SELECT name, value FROM counters").fetchall())
            note = self._db.execute("SELECT value FROM notes WHERE name = 'last_error'").fetchone()
            depth = int(self._db.execute("SELECT COUNT(*) FROM items").fetchone()[0])
        return SpoolStats(
            depth=depth,
            last_error=note[0] if note else None,
            max_items=self.max_items,
            **{name: int(counts.get(name, 0)) for name in _COUNTERS},
        )

    def close(self) -> None:
        """Close the database; what is left here is adopted by the next spool that looks."""
        with self._lock:
            self._db.close()
            if self._owner.is_locked:
                self._owner.release()
                (self.directory / OWNERS / f"{self.token}.lock").unlink(missing_ok=True)

    # ------------------------------------------------------------------ the server run it belongs to

    @property
    def server_run(self) -> str | None:
        """The run of the server (its ``run_id``) whose policy sampled what is spooled here."""
        with self._lock:
            note = self._db.execute("SELECT value FROM notes WHERE name = 'server_run'").fetchone()
        return note[0] if note else None

    def bind(self, run_id: str | None) -> None:
        """Note that what is spooled from now on was sampled for the server run ``run_id``."""
        if run_id is not None:
            with self._lock, self._write() as db:
                db.execute("INSERT OR REPLACE INTO notes (name, value) VALUES ('server_run', ?)", (run_id,))

    # ------------------------------------------------------------------ internals

    @staticmethod
    def _count_in_group(db: sqlite3.Connection, group_id: str) -> None:
        db.execute("UPDATE task_groups SET spooled = spooled + 1 WHERE group_id = ?", (group_id,))
        db.execute("DELETE FROM task_groups WHERE group_id = ? AND spooled >= size", (group_id,))

    @contextlib.contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One transaction: commits on success, rolls back on error; SQLite errors become SpoolError."""
        try:
            with transaction(self._db) as db:
                yield db
        except sqlite3.Error as exc:
            raise SpoolError(f"could not write the spool in {self.directory}: {exc}") from exc


class GroupCommit(Generic[T, R]):
    """The async side of a blocking batch write (``Spool.put_many``, the gateway journal's call notes):
    ``await put(item)`` returns that item's result once it is committed. Items that arrive while a commit is
    in flight go together into the next one (group commit: one worker-thread hop, one transaction and one
    flush for all of them), so durability costs one disk flush per burst, not one per item."""

    def __init__(self, commit: Callable[[list[T]], list[R]]) -> None:
        self._commit = commit
        self.commits = 0
        self._queue: list[tuple[T, asyncio.Future[R]]] = []
        self._committer: asyncio.Task[None] | None = None

    async def put(self, item: T) -> R:
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._queue.append((item, future))
        if self._committer is None or self._committer.done():
            self._committer = asyncio.create_task(self._run())
        return await future

    async def _run(self) -> None:
        while self._queue:
            batch, self._queue = self._queue, []
            try:
                results = await asyncio.to_thread(self._commit, [item for item, _ in batch])
            except Exception as exc:  # e.g. the disk is full: every item of the group gets the error
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            self.commits += 1
            for (_, future), result in zip(batch, results, strict=True):
                if not future.done():
                    future.set_result(result)
