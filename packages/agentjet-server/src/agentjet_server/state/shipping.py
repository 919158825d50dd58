"""Log shipping: the trajectory log's bytes copied to the object store as they are written.

``TrajectoryLog.append`` hands each write to ``LogShipper.appended`` (it only queues). One thread
puts everything queued for a segment as one object, ``log/<seg>/<start>-<end>.part`` (a group
commit: the pushes that arrived meanwhile share it), and moves the watermark. With ``--remote-log
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
        self.error: str | None = None
        self.parts = 0  # puts made
        self._thread = threading.Thread(target=self._run, name="log-shipper", daemon=True)
        self._thread.start()

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
            while self._queue:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return False
                self._cond.wait(min(left, 1.0))
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
        self._thread.join(timeout=10)

    # -- the thread ------------------------------------------------------------------------------
    def _next(self) -> tuple[int, int, list[bytes]] | None:
        """The queued bytes that go in the next put (contiguous, one segment), left queued until
        shipped; None when closing with nothing queued."""
        with self._cond:
            while not self._queue:
                if self._closing:
                    return None
                self._cond.wait()
            segment, offset, data = self._queue[0]
            if not data:  # a new segment: nothing to put
                self._queue.popleft()
                self._shipped = max(self._shipped, (segment, 0))
                self._cond.notify_all()
                return segment, offset, []
            chunks, end = [data], offset + len(data)
            for seg, off, more in list(self._queue)[1:]:
                if seg != segment or off != end or not more or end - offset >= MAX_PART:
                    break
                chunks.append(more)
                end += len(more)
            return segment, offset, chunks

    def _run(self) -> None:
        delay = 0.1
        while True:
            job = self._next()
            if job is None:
                return
            segment, offset, chunks = job
            if not chunks:
                continue
            data = b"".join(chunks)
            try:
                self.store.put(part_key(segment, offset, offset + len(data)), data)
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
            self.error, delay = None, 0.1
            with self._cond:
                for _ in chunks:
                    self._queue.popleft()
                self._queued -= len(data)
                self.parts += 1
                self._shipped = (segment, offset + len(data))
                self._cond.notify_all()
