"""The server's write-ahead log of ingested trajectories, under ``<state-dir>/log/``.

Every trajectory the server accepts is appended here and fsynced before the client gets its
answer; so are the ids of rejected ones (a resend after a crash is then a duplicate, not a second
decision) and each policy version the learner publishes. Records carry a log sequence number
(``lsn``, the order in which accepted trajectories reached the group buffer) so that a checkpoint
can name the trajectories it had buffered and resume can replay the rest in the same order.

On disk: segments ``00000001.wal``, ``00000002.wal``, ... (a new one after each checkpoint), one
record per line, ``<crc32 hex> <json>``. A crash can tear the last line of the last segment (it
was never acknowledged, since its fsync had not returned); opening the log truncates it. A
segment whose trajectories are all trained and checkpointed is compacted into ``<n>.ids`` (the
ids, answers and turn signatures only: the set of seen ids, and of trained samples, must outlive
the data) and removed. An ``.ids`` row is ``[kind, id, reason, lsn, [signatures]]``.
"""

from __future__ import annotations

import json
import logging
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentjet_server.errors import StateError

logger = logging.getLogger(__name__)

ACCEPTED, REJECTED, VERSION = "a", "r", "v"


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _encode(record: dict[str, Any]) -> bytes:
    body = json.dumps(record, separators=(",", ":"), ensure_ascii=False).encode()
    return b"%08x %s\n" % (zlib.crc32(body), body)


def _decode(line: bytes) -> dict[str, Any] | None:
    """The record on a whole line, or None if it is torn or corrupt."""
    if not line.endswith(b"\n") or len(line) < 10 or line[8:9] != b" ":
        return None
    body = line[9:-1]
    try:
        if int(line[:8], 16) != zlib.crc32(body):
            return None
        record = json.loads(body)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def _signatures(trajectory: dict[str, Any]) -> list[str]:
    return [t["signature"] for t in trajectory.get("turns") or [] if t.get("signature")]


def _read_segment(path: Path) -> Iterator[dict[str, Any]]:
    with path.open("rb") as f:
        for line in f:
            record = _decode(line)
            if record is None:  # a torn last record: never answered
                return
            yield record


def read_records(directory: Path) -> Iterator[dict[str, Any]]:
    """The records of every segment in ``directory``, oldest first, without opening the log for
    writing (safe while a server is appending: a half-written last record is skipped)."""
    for path in sorted(p for p in directory.glob("*.wal") if p.stem.isdigit()):
        yield from _read_segment(path)


@dataclass
class LogScan:
    """What opening the log found: every id seen, counts, the highest version, and the
    accepted trajectories (raw dicts) that resume may need, by lsn."""

    seen: set[str] = field(default_factory=set)
    accepted: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    next_lsn: int = 0
    max_version: int = 0
    trajectories: dict[int, dict[str, Any]] = field(default_factory=dict)
    torn_bytes: int = 0
    signatures: set[str] = field(default_factory=set)  # of every accepted turn: each is trained once


class TrajectoryLog:
    """Append-only, fsynced, segmented. Not thread-safe: the trajectory store serialises writers."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
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
            if number in live:  # compaction crashed before removing the segment: the segment wins
                continue
            for row in (self.directory / f"{number:08d}.ids").read_text().splitlines():
                kind, trajectory_id, reason, lsn, *signatures = json.loads(row)
                self._count(scan, kind, trajectory_id, reason)
                if kind == ACCEPTED:
                    scan.next_lsn = max(scan.next_lsn, int(lsn) + 1)
                    scan.signatures.update(*signatures)
        segments = sorted(live)
        for number in segments:
            path = self.directory / f"{number:08d}.wal"
            good = 0
            with path.open("rb") as f:
                for line in f:
                    record = _decode(line)
                    if record is None:
                        break
                    good += len(line)
                    self._apply(scan, record)
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

    @staticmethod
    def _count(scan: LogScan, kind: str, trajectory_id: str, reason: str | None) -> None:
        scan.seen.add(trajectory_id)
        if kind == ACCEPTED:
            scan.accepted += 1
        else:
            scan.rejected[reason or "rejected"] = scan.rejected.get(reason or "rejected", 0) + 1

    def _apply(self, scan: LogScan, record: dict[str, Any]) -> None:
        kind = record.get("k")
        if kind == ACCEPTED:
            trajectory = record["t"]
            self._count(scan, ACCEPTED, trajectory["id"], None)
            scan.signatures.update(_signatures(trajectory))
            scan.trajectories[int(record["n"])] = trajectory
            scan.next_lsn = max(scan.next_lsn, int(record["n"]) + 1)
        elif kind == REJECTED:
            self._count(scan, REJECTED, record["id"], record.get("why"))
        elif kind == VERSION:
            scan.max_version = max(scan.max_version, int(record["v"]))

    def answers(self) -> Iterator[tuple[str, str]]:
        """``(kind, trajectory id)`` for every accepted (``a``) or rejected (``r``) trajectory ever
        logged, compacted segments included, oldest first."""
        live = set(self._segments())
        for number in sorted(live | set(self._compacted())):
            if number in live:
                for record in self._segment_records(number):
                    if record.get("k") == ACCEPTED:
                        yield ACCEPTED, record["t"]["id"]
                    elif record.get("k") == REJECTED:
                        yield REJECTED, record["id"]
            else:
                for row in (self.directory / f"{number:08d}.ids").read_text().splitlines():
                    kind, trajectory_id, *_ = json.loads(row)
                    yield kind, trajectory_id

    def _segment_records(self, number: int) -> Iterator[dict[str, Any]]:
        return _read_segment(self.directory / f"{number:08d}.wal")

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

    def append(self, records: list[dict[str, Any]]) -> None:
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
        data = b"".join(_encode(r) for r in records)
        try:
            self._write_all(data)
        except OSError as exc:
            self._damaged = True
            self._restore()
            raise StateError(f"cannot write the trajectory log in {self.directory}: {exc}") from exc
        self._good += len(data)

    def rotate(self) -> int:
        """Start a new segment; returns its number (records before it are in older segments).
        The new segment is opened before the old one is let go: if it can't be (read-only or full
        disk), StateError is raised and appends go on into the current segment."""
        if self._damaged and not self._restore():
            raise StateError(f"the trajectory log segment {self._segment} could not be repaired; not rotating")
        fd, size = self._open_segment(self._segment + 1)
        old = self._fd
        self._fd, self._good, self._segment = fd, size, self._segment + 1
        try:
            os.close(old)
        except OSError as exc:
            logger.warning("trajectory log: closing segment %d: %s", self._segment - 1, exc)
        return self._segment

    def compact(self, keep_from_lsn: int, before_segment: int) -> int:
        """Reduce segments older than ``before_segment`` whose trajectories all have an lsn below
        ``keep_from_lsn`` (trained and checkpointed) to their ids. Returns how many were compacted."""
        done = 0
        for number in self._segments():
            if number >= before_segment:
                break
            path = self.directory / f"{number:08d}.wal"
            rows: list[list[Any]] = []
            for record in _read_segment(path):
                if record.get("k") == ACCEPTED:
                    if int(record["n"]) >= keep_from_lsn:
                        return done  # still needed by resume; so are the segments after it
                    rows.append([ACCEPTED, record["t"]["id"], None, record["n"], _signatures(record["t"])])
                elif record.get("k") == REJECTED:
                    rows.append([REJECTED, record["id"], record.get("why"), None])
            target = self.directory / f"{number:08d}.ids"
            tmp = target.with_suffix(".ids.tmp")
            with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
                f.writelines(json.dumps(row) + "\n" for row in rows)
                f.flush()
                os.fsync(f.fileno())
            tmp.replace(target)
            fsync_dir(self.directory)
            path.unlink()
            fsync_dir(self.directory)
            done += 1
        return done

    def close(self) -> None:
        if self._fd >= 0:
            if self._damaged:
                self._restore()
            os.close(self._fd)
            self._fd = -1

    def forget(self) -> None:
        """Drop the raw trajectories kept from the scan once resume has replayed them."""
        self.scan.trajectories = {}
