"""Log shipping: the trajectory log's bytes copied to the object store as they are written.

``TrajectoryLog.append`` hands each write to ``LogShipper.appended`` (it only queues). A few threads
each put everything queued for a segment as one object, ``log/<seg>/<start>-<end>.part`` (a group
commit: the pushes that arrived meanwhile share it; several puts are in flight at once), and the
watermark moves over the puts that finished, in log order. With ``--remote-log
ack`` a push is answered only once the watermark passes its records (``wait``), so an acknowledged
trajectory is in the bucket even if the server's disk is lost; with ``async`` the answer does not
wait (while less than ``max_lag`` bytes are queued), and a lost disk loses the unshipped tail.

The shipper sends the bytes it was given and never re-reads a segment, so local compaction cannot
race it. A failed put is retried with backoff; waiting pushes get StateError (a 503: nothing
acknowledged, retry) after ``timeout`` seconds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Literal

from agentjet_server.errors import StateError
from agentjet_server.ingest.wal import Position
from agentjet_server.state.objectstore import ObjectStore, part_key

logger = logging.getLogger(__name__)

MAX_PART = 32 << 20  # bytes in one put at most
LINGER = 0.2  # with --remote-log async, seconds between puts while little is queued
PUTS_IN_FLIGHT = 4  # puts sent at once: a push waits about one round trip to the store, not two


class LogShipper:
    def __init__(
        self,
        store: ObjectStore,
        start: Position,
        *,
        mode: Literal["ack", "async"] = "ack",
        timeout: float = 30.0,
        max_lag: int = 64 << 20,
    ) -> None:
        self.store = store
        self.mode = mode
        self.timeout = timeout
        self.max_lag = max_lag
        self._cond = threading.Condition()
        self._queue: deque[tuple[int, int, bytes]] = deque()  # (segment, offset, bytes); b"" marks a new segment
        self._queued = 0  # bytes
        self._shipped: Position = start
        self._closing = False
        self._flushing = 0  # flushes waiting: no lingering then
        self._not_before = 0.0  # with ``async``, no put before this (monotonic) time
        self.error: str | None = None
        self.parts = 0  # puts made
        self._flight: deque[list[int]] = deque()  # puts taken off the queue, in log order: [segment, start, end, done]
        self._bodies: dict[int, bytes] = {}
        self._threads = [
            threading.Thread(target=self._run, name=f"log-shipper-{n}", daemon=True) for n in range(PUTS_IN_FLIGHT)
        ]
        for thread in self._threads:
            thread.start()

    # -- the log's side (under the trajectory store's lock: queue and return) -------------------
    def appended(self, segment: int, offset: int, data: bytes) -> None:
        with self._cond:
            self._queue.append((segment, offset, data))
            self._queued += len(data)
            self._cond.notify_all()

    def rotated(self, segment: int) -> None:
        with self._cond:
            self._queue.append((segment, 0, b""))
            self._cond.notify_all()

    # -- a push's side ---------------------------------------------------------------------------
    def wait(self, position: Position) -> None:
        """Return once the bucket holds the log up to ``position`` (``async``: at once, while the
        queue is under ``max_lag``); StateError after ``timeout`` seconds."""
        with self._cond:
            if self.mode == "async" and self._queued <= self.max_lag:
                return
            deadline = time.monotonic() + self.timeout
            while not self._reached(position):
                left = deadline - time.monotonic()
                if left <= 0 or self._closing:
                    why = f": {self.error}" if self.error else ""
                    raise StateError(
                        f"the object store {self.store.uri} has not taken the trajectory log for {self.timeout:g} s"
                        f"{why}; nothing of this push is acknowledged: retry it"
                    )
                self._cond.wait(left)

    def _reached(self, position: Position) -> bool:
        if self.mode == "async":
            return self._queued <= self.max_lag
        return self._shipped >= position

    def flush(self, timeout: float) -> bool:
        """Wait until everything queued is shipped; False if ``timeout`` passed first."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._flushing += 1
            self._cond.notify_all()
            try:
                while self._queue or self._flight:
                    left = deadline - time.monotonic()
                    if left <= 0 or not any(t.is_alive() for t in self._threads):
                        return False
                    self._cond.wait(min(left, 1.0))
            finally:
                self._flushing -= 1
        return True

    def wait_shipped(self, position: Position, stop: threading.Event) -> bool:
        """Block (without a deadline) until the bucket holds the log up to ``position``; False if
        ``stop`` is set first. The checkpoint uploader waits so before it writes a manifest."""
        with self._cond:
            while self._shipped < position:
                if stop.is_set() or self._closing:
                    return False
                self._cond.wait(1.0)
        return True

    @property
    def lag_bytes(self) -> int:
        with self._cond:
            return self._queued

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(timeout=10)

    # -- the threads ----------------------------------------------------------------------------
    def _next(self) -> list[int] | None:
        """Take the next put off the queue: the contiguous bytes of one segment, as an entry
        ``[segment, start, end, done]`` of ``_flight`` (in log order); None when closing with nothing left."""
        with self._cond:
            while not self._queue or (self._lingering() and not self._closing):
                if not self._queue and self._closing:
                    return None
                self._cond.wait(max(self._not_before - time.monotonic(), 0.001) if self._queue else None)
            segment, offset, data = self._queue.popleft()
            end, chunks = offset + len(data), [data]
            while data and self._queue and end - offset < MAX_PART:
                seg, off, more = self._queue[0]
                if seg != segment or off != end or not more:
                    break
                self._queue.popleft()
                chunks.append(more)
                end += len(more)
            entry = [segment, offset, end, 0]
            self._flight.append(entry)
            self._bodies[id(entry)] = b"".join(chunks)
            if self.mode == "async":  # nobody waits: fewer, larger puts (each costs the server CPU)
                self._not_before = time.monotonic() + LINGER
            return entry

    def _lingering(self) -> bool:
        """With ``async``, a put waits ``LINGER`` after the last (unless much is queued, or a flush waits)."""
        return self._queued < MAX_PART and not self._flushing and time.monotonic() < self._not_before

    def _done(self, entry: list[int]) -> None:
        """``entry`` is in the bucket: the watermark moves over every finished put before the first unfinished one."""
        with self._cond:
            entry[3] = 1
            while self._flight and self._flight[0][3]:
                segment, start, end, _ = self._flight.popleft()
                self._queued -= end - start
                self._shipped = (segment, end) if end > start else max(self._shipped, (segment, 0))
            self._cond.notify_all()

    def _run(self) -> None:
        """One of ``PUTS_IN_FLIGHT`` threads: each takes the next put, and retries it until the store takes it."""
        while True:
            entry = self._next()
            if entry is None:
                return
            segment, start, end, _ = entry
            data = self._bodies.pop(id(entry))
            delay = 0.1
            while data:
                try:
                    self.store.put(part_key(segment, start, end), data)
                except StateError as exc:
                    if self.error is None:
                        logger.error("log shipping: %s (retrying)", exc)
                    self.error = str(exc)
                    with self._cond:
                        if self._closing:
                            return
                        self._cond.wait(delay)
                    delay = min(delay * 2, 5.0)
                    continue
                if self.error is not None:
                    logger.info("log shipping: the object store takes the log again")
                self.error = None
                with self._cond:
                    self.parts += 1
                break
            self._done(entry)
