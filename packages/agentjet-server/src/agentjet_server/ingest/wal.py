"""The server's write-ahead log of ingested trajectories, under ``<state-dir>/log/``.

Every trajectory the server accepts is appended here and fsynced before the client gets its
answer; so are the ids of rejected ones (a resend after a crash is then a duplicate, not a second
decision) and each policy version the learner publishes. Records carry a log sequence number
(``lsn``, the order in which accepted trajectories reached the group buffer) so that a checkpoint
can name the trajectories it had buffered and resume can replay the rest in the same order.

On disk: segments ``00000001.wal``, ``00000002.wal``, ... (a new one after each checkpoint), one
record per line, ``<crc32 hex> <json>``. The records (typed below, each with one ``to_json`` /
``from_json``):

    {"k": "a", "n": lsn, "t": trajectory}        Accepted: buffered for training
    {"k": "r", "id": id, "why": reason}          Rejected
    {"k": "e", "t": trajectory}                  Evaluated: an evaluation episode, never trained
    {"k": "v", "v": version, "a": {name: n}}     Published: a policy version about to go live ("a": the
                                                 adapters' own versions it brings, with an adapter per agent)
    {"k": "c", "c": change, "live": {...}, "paused": bool}   Configured: an admin API change

A crash can tear the last line of the last segment (it was never acknowledged, since its fsync
had not returned); opening the log truncates it. A segment whose trajectories are all trained and
checkpointed is compacted into ``<n>.ids`` (the ids, answers and turn signatures only: the set of
seen ids, and of trained samples, must outlive the data) and removed; an ``.ids`` row is
``[kind, id, reason, lsn, [signatures]]``. The newest compacted trajectories keep their bodies in
``recent.wal`` (same line format), so they stay inspectable. ``read_records`` is the one iterator
over all of it.
"""

from __future__ import annotations

import json
import logging
import os
import zlib
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from agentjet_server.errors import StateError

logger = logging.getLogger(__name__)

ACCEPTED, REJECTED, VERSION, EVALUATED, CONFIGURED = "a", "r", "v", "e", "c"
_ACCEPTED_JSON, _EVALUATED_JSON = json.dumps(ACCEPTED).encode(), json.dumps(EVALUATED).encode()
RECENT = "recent.wal"  # bodies of the newest compacted trajectories, for inspection and the dashboard


@dataclass(frozen=True)
class Accepted:
    """A trajectory accepted for training, with its log sequence number. ``trajectory`` (the raw
    JSON) is None once its segment is compacted: the id and turn signatures outlive it."""

    lsn: int
    id: str
    signatures: tuple[str, ...] = ()
    trajectory: dict[str, Any] | None = None
    # at ingest: the trajectory's JSON as its model wrote it, logged as is (no dict, no json.dumps)
    raw: bytes | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Rejected:
    id: str
    reason: str


@dataclass(frozen=True)
class Evaluated:
    """An evaluation episode: recorded (its id is seen, its samples are spent), never trained."""

    id: str
    signatures: tuple[str, ...] = ()
    trajectory: dict[str, Any] | None = None
    raw: bytes | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Published:
    """A policy version the learner is about to publish; with an adapter per agent, the adapters' own
    versions it brings (every adapter's, not only those that change)."""

    version: int
    adapters: dict[str, int] | None = None


@dataclass(frozen=True)
class Configured:
    """A change made through the admin API; ``live`` is every live setting changed so far (the
    newest record says all), ``paused`` whether learning is paused."""

    change: dict[str, Any]
    live: dict[str, Any]
    paused: bool


Record = Accepted | Rejected | Evaluated | Published | Configured
Position = tuple[int, int]  # (segment, byte offset): how far the log reaches


class LogMirror(Protocol):
    """Where the log's bytes are copied as they are written (``state/shipping.py``: an object store).
    ``appended`` and ``rotated`` only queue (they run while ingestion is held still); ``wait`` returns
    once everything up to ``position`` is copied, else raises StateError."""

    def appended(self, segment: int, offset: int, data: bytes) -> None: ...

    def rotated(self, segment: int) -> None: ...

    def wait(self, position: Position) -> None: ...


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _signatures(trajectory: dict[str, Any]) -> tuple[str, ...]:
    return tuple(t["signature"] for t in trajectory.get("turns") or [] if t.get("signature"))


def to_json(record: Record) -> dict[str, Any]:
    """The record as the JSON object of its log line (the format described above)."""
    if isinstance(record, Accepted):
        return {"k": ACCEPTED, "n": record.lsn, "t": record.trajectory}
    if isinstance(record, Rejected):
        return {"k": REJECTED, "id": record.id, "why": record.reason}
    if isinstance(record, Evaluated):
        return {"k": EVALUATED, "t": record.trajectory}
    if isinstance(record, Published):
        if record.adapters is None:
            return {"k": VERSION, "v": record.version}
        return {"k": VERSION, "v": record.version, "a": record.adapters}
    return {"k": CONFIGURED, "c": record.change, "live": record.live, "paused": record.paused}


def from_json(value: dict[str, Any]) -> Record | None:
    """The record a log line holds (None for a kind this version does not know: skipped)."""
    kind = value.get("k")
    if kind == ACCEPTED:
        t = value["t"]
        return Accepted(int(value["n"]), t["id"], _signatures(t), t)
    if kind == REJECTED:
        return Rejected(value["id"], value.get("why") or "rejected")
    if kind == EVALUATED:
        t = value["t"]
        return Evaluated(t["id"], _signatures(t), t)
    if kind == VERSION:
        adapters = value.get("a")
        return Published(int(value["v"]), {str(k): int(v) for k, v in adapters.items()} if adapters else None)
    if kind == CONFIGURED:
        return Configured(value.get("c") or {}, value.get("live") or {}, bool(value.get("paused")))
    return None


def encode(record: Record) -> bytes:
    if isinstance(record, Accepted) and record.raw is not None:
        body = b'{"k":%s,"n":%d,"t":%s}' % (_ACCEPTED_JSON, record.lsn, record.raw)
    elif isinstance(record, Evaluated) and record.raw is not None:
        body = b'{"k":%s,"t":%s}' % (_EVALUATED_JSON, record.raw)
    else:
        body = json.dumps(to_json(record), separators=(",", ":"), ensure_ascii=False).encode()
    return b"%08x %s\n" % (zlib.crc32(body), body)


def _line_value(line: bytes) -> dict[str, Any] | None:
    """The JSON object on a whole line, or None if the line is torn or corrupt."""
    if not line.endswith(b"\n") or len(line) < 10 or line[8:9] != b" ":
        return None
    body = line[9:-1]
    try:
        if int(line[:8], 16) != zlib.crc32(body):
            return None
        value = json.loads(body)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def decode(line: bytes) -> Record | None:
    """The record on a whole line, or None if it is torn, corrupt or of a kind not known here."""
    value = _line_value(line)
    return from_json(value) if value is not None else None


def _id_row(record: Record) -> list[Any] | None:
    """A compacted ``.ids`` row: what must outlive the record's data."""
    if isinstance(record, Accepted):
        return [ACCEPTED, record.id, None, record.lsn, list(record.signatures)]
    if isinstance(record, Rejected):
        return [REJECTED, record.id, record.reason, None]
    if isinstance(record, Evaluated):
        return [EVALUATED, record.id, None, None, list(record.signatures)]
    return None  # versions and configuration: the checkpoint that allowed compaction holds them


def _from_id_row(row: list[Any]) -> Record:
    kind, trajectory_id, reason, lsn, *rest = row
    signatures = tuple(rest[0]) if rest else ()
    if kind == ACCEPTED:
        return Accepted(int(lsn), trajectory_id, signatures)
    if kind == EVALUATED:
        return Evaluated(trajectory_id, signatures)
    return Rejected(trajectory_id, reason or "rejected")


def _read_segment(path: Path) -> Iterator[tuple[Record | None, int]]:
    """``(record, line length)`` for each whole line (record None: a kind not known here); stops
    at a torn or corrupt line (the caller compares what it read with the file's size)."""
    with path.open("rb") as f:
        for line in f:
            value = _line_value(line)
            if value is None:
                return
            yield from_json(value), len(line)


def _segment_numbers(directory: Path, suffix: str) -> list[int]:
    return sorted(int(p.stem) for p in directory.glob(f"*{suffix}") if p.stem.isdigit())


def read_records(directory: Path, *, compacted: bool = False, recent: bool = False) -> Iterator[Record]:
    """Every record in the log ``directory``, oldest first: the one iterator that replay, compaction,
    inspection and the dashboard share. Safe while a server appends (a half-written last line is
    skipped). ``compacted`` also yields what compacted segments keep (ids and signatures, no
    trajectory); ``recent`` first yields the bodies kept from compacted segments (``recent.wal``)."""
    if recent and (directory / RECENT).exists():
        for record, _ in _read_segment(directory / RECENT):
            if record is not None:
                yield record
    live = _segment_numbers(directory, ".wal")
    numbers = sorted(set(live) | set(_segment_numbers(directory, ".ids"))) if compacted else live
    for number in numbers:
        if number in live:  # a compaction that crashed before removing its segment: the segment wins
            for record, _ in _read_segment(directory / f"{number:08d}.wal"):
                if record is not None:
                    yield record
        else:
            for row in (directory / f"{number:08d}.ids").read_text().splitlines():
                yield _from_id_row(json.loads(row))


@dataclass
class LogScan:
    """What opening the log found: every id seen, counts, the highest version, the newest admin
    configuration, and the accepted trajectories (raw dicts) that resume may need, by lsn."""

    seen: set[str] = field(default_factory=set)
    accepted: int = 0
    evaluated: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    next_lsn: int = 0
    max_version: int = 0
    max_adapter_versions: dict[str, int] = field(default_factory=dict)
    trajectories: dict[int, dict[str, Any]] = field(default_factory=dict)
    torn_bytes: int = 0
    signatures: set[str] = field(default_factory=set)  # of every accepted turn: each is trained once
    configured: Configured | None = None  # the newest admin change still in the log

    def apply(self, record: Record) -> None:
        if isinstance(record, Accepted):
            self.seen.add(record.id)
            self.accepted += 1
            self.signatures.update(record.signatures)
            if record.trajectory is not None:
                self.trajectories[record.lsn] = record.trajectory
            self.next_lsn = max(self.next_lsn, record.lsn + 1)
        elif isinstance(record, Evaluated):
            self.seen.add(record.id)
            self.evaluated += 1
            self.signatures.update(record.signatures)
        elif isinstance(record, Rejected):
            self.seen.add(record.id)
            self.rejected[record.reason] = self.rejected.get(record.reason, 0) + 1
        elif isinstance(record, Published):
            self.max_version = max(self.max_version, record.version)
            for name, count in (record.adapters or {}).items():
                self.max_adapter_versions[name] = max(self.max_adapter_versions.get(name, 0), count)
        else:
            self.configured = record


class TrajectoryLog:
    """Append-only, fsynced, segmented. Not thread-safe: the trajectory store serialises writers."""

    def __init__(self, directory: Path, mirror: LogMirror | None = None) -> None:
        self.directory = directory
        self.mirror = mirror
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise StateError(f"cannot create the trajectory log in {directory}: {exc}; check --state-dir") from exc
        self.scan = self._scan()
        segments = self._segments()
        self._segment = segments[-1] if segments else 1
        # the open segment, and how many of its bytes hold whole, acknowledged records; after a
        # failed write (``_damaged``) there may be more, which are cut off before the next one
        self._fd, self._good = self._open_segment(self._segment)
        self._damaged = False

    # -- reading -------------------------------------------------------------------------------
    def _segments(self) -> list[int]:
        return sorted(int(p.stem) for p in self.directory.glob("*.wal") if p.stem.isdigit())

    def _compacted(self) -> list[int]:
        return sorted(int(p.stem) for p in self.directory.glob("*.ids") if p.stem.isdigit())

    def _scan(self) -> LogScan:
        scan = LogScan()
        live = set(self._segments())
        for number in self._compacted():
            if number not in live:  # compaction crashed before removing the segment: the segment wins
                for row in (self.directory / f"{number:08d}.ids").read_text().splitlines():
                    scan.apply(_from_id_row(json.loads(row)))
        segments = sorted(live)
        for number in segments:
            path = self.directory / f"{number:08d}.wal"
            good = 0
            for record, length in _read_segment(path):
                good += length
                if record is not None:
                    scan.apply(record)
            size = path.stat().st_size
            if good < size:
                if number != segments[-1]:
                    raise StateError(
                        f"the trajectory log segment {path} is corrupt at byte {good} (not at the end of the "
                        "log, so it is not a torn last write); restore the state dir from a backup"
                    )
                logger.warning("trajectory log: dropping a torn last record (%d bytes, never answered)", size - good)
                with path.open("r+b") as f:
                    f.truncate(good)
                    os.fsync(f.fileno())
                scan.torn_bytes = size - good
        return scan

    def answers(self) -> Iterator[tuple[str, str]]:
        """``(kind, trajectory id)`` for every accepted (``a``), evaluated (``e``) or rejected
        (``r``) trajectory ever logged, compacted segments included, oldest first."""
        for record in read_records(self.directory, compacted=True):
            if isinstance(record, Accepted):
                yield ACCEPTED, record.id
            elif isinstance(record, Evaluated):
                yield EVALUATED, record.id
            elif isinstance(record, Rejected):
                yield REJECTED, record.id

    # -- writing -------------------------------------------------------------------------------
    def _open_segment(self, number: int) -> tuple[int, int]:
        """An unbuffered append-only descriptor on segment ``number`` (created, 0600, if missing) and
        the segment's size: a failed write leaves nothing in a user-space buffer for a later one to flush."""
        path = self.directory / f"{number:08d}.wal"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        except OSError as exc:
            raise StateError(f"cannot open the trajectory log segment {path}: {exc}") from exc
        try:
            fsync_dir(self.directory)  # a new segment's name is durable before anything is written to it
        except OSError as exc:
            os.close(fd)
            raise StateError(f"cannot make the new trajectory log segment {path} durable: {exc}") from exc
        return fd, os.fstat(fd).st_size

    def _write_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            written = os.write(self._fd, view)
            if written <= 0:
                raise OSError(f"short write ({written} bytes)")
            view = view[written:]
        os.fsync(self._fd)

    def _restore(self) -> bool:
        """Cut the segment back to its last good offset (what every acknowledged record ends at).
        True when the segment is whole again; False leaves the log refusing writes until it is."""
        try:
            if os.fstat(self._fd).st_size != self._good:
                os.ftruncate(self._fd, self._good)
                os.fsync(self._fd)
        except OSError as exc:
            logger.error("trajectory log: cannot cut segment %d back to byte %d: %s", self._segment, self._good, exc)
            return False
        self._damaged = False
        return True

    def append(self, records: Sequence[Record]) -> None:
        """Write ``records`` and return once they are on disk. On any failure nothing of them stays:
        the segment is cut back to where the last acknowledged record ends before StateError is
        raised (so a later append can't publish a record whose writer was told it failed)."""
        if not records:
            return
        if self._damaged and not self._restore():
            raise StateError(
                f"the trajectory log in {self.directory} could not be repaired after a failed write; "
                "free disk space or fix the state dir's permissions"
            )
        data = b"".join(encode(r) for r in records)
        try:
            self._write_all(data)
        except OSError as exc:
            self._damaged = True
            self._restore()
            raise StateError(f"cannot write the trajectory log in {self.directory}: {exc}") from exc
        self._good += len(data)
        if self.mirror is not None:
            self.mirror.appended(self._segment, self._good - len(data), data)

    @property
    def position(self) -> Position:
        """Where the acknowledged records end: a later ``wait_mirrored`` of it covers them all."""
        return self._segment, self._good

    def wait_mirrored(self, position: Position) -> None:
        """With a mirror, return once it holds the log up to ``position`` (StateError when it can't)."""
        if self.mirror is not None:
            self.mirror.wait(position)

    def rotate(self) -> int:
        """Start a new segment; returns its number (records before it are in older segments).
        The new segment is opened before the old one is let go: if it can't be (read-only or full
        disk), StateError is raised and appends go on into the current segment."""
        if self._damaged and not self._restore():
            raise StateError(f"the trajectory log segment {self._segment} could not be repaired; not rotating")
        fd, size = self._open_segment(self._segment + 1)
        old = self._fd
        self._fd, self._good, self._segment = fd, size, self._segment + 1
        if self.mirror is not None:
            self.mirror.rotated(self._segment)
        try:
            os.close(old)
        except OSError as exc:
            logger.warning("trajectory log: closing segment %d: %s", self._segment - 1, exc)
        return self._segment

    def compact(self, keep_from_lsn: int, before_segment: int, keep_recent: int = 0) -> list[int]:
        """Reduce segments older than ``before_segment`` whose trajectories all have an lsn below
        ``keep_from_lsn`` (trained and checkpointed) to their ids. The bodies of the newest
        ``keep_recent`` trajectories among them (and those kept before) stay in ``recent.wal``, for
        inspection and the dashboard. Returns the numbers of the segments compacted."""
        done: list[int] = []
        recent: deque[Record] = deque(maxlen=keep_recent) if keep_recent else deque(maxlen=0)
        for number in self._segments():
            if number >= before_segment:
                break
            path = self.directory / f"{number:08d}.wal"
            rows: list[list[Any]] = []
            bodies: list[Record] = []
            needed = False
            for record, _ in _read_segment(path):
                if isinstance(record, Accepted) and record.lsn >= keep_from_lsn:
                    needed = True  # still needed by resume; so are the segments after it
                    break
                row = _id_row(record) if record is not None else None
                if row is not None:
                    rows.append(row)
                if isinstance(record, Accepted | Evaluated):
                    bodies.append(record)
            if needed:
                break
            if keep_recent:
                if not done:  # the bodies kept by earlier compactions come first
                    recent.extend(r for r, _ in self._recent_records())
                recent.extend(bodies)
                self._write_atomically(self.directory / RECENT, b"".join(encode(r) for r in recent))
            self._write_atomically(
                self.directory / f"{number:08d}.ids", "".join(json.dumps(r) + "\n" for r in rows).encode()
            )
            path.unlink()
            fsync_dir(self.directory)
            done.append(number)
        return done

    def _recent_records(self) -> Iterator[tuple[Record, int]]:
        path = self.directory / RECENT
        if path.exists():
            for record, length in _read_segment(path):
                if record is not None:
                    yield record, length

    def _write_atomically(self, target: Path, data: bytes) -> None:
        tmp = target.with_name(target.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        tmp.replace(target)
        fsync_dir(self.directory)

    def close(self) -> None:
        if self._fd >= 0:
            if self._damaged:
                self._restore()
            os.close(self._fd)
            self._fd = -1

    def forget(self) -> None:
        """Drop the raw trajectories kept from the scan once resume has replayed them."""
        self.scan.trajectories = {}
