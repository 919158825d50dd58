"""Connections: how many the server holds, and for how long, so no client can lock the others out.

uvicorn on its own keeps a connection that sends nothing, or sends its headers a byte at a time,
or stops reading a streamed answer, open forever; with the common open-file limit of 1,024 about a
thousand such connections leave no descriptor for the next client (and no file for the log). So:

- at start the soft open-file limit is raised to the hard one (``raise_open_file_limit``);
- ``guarded_protocol`` is uvicorn's HTTP/1.1 protocol on httptools (a C parser: h11's pure-Python one was
  about a third of the event loop's time a request) with three timers and a cap: request
  headers must be complete ``header_timeout`` seconds after the connection opens (or after the
  previous answer on a kept-alive one); a reader that lets the server's send buffer stay full for
  ``write_timeout`` seconds is disconnected; and at ``max_connections`` a new connection pushes
  out the longest-idle one that is not in a request (or, with none idle, is answered 503);
- bodies have their own deadline (``bodies.read_body``);
- a condition that repeats (connections refused, descriptors exhausted) is logged once, then
  counted in one line a minute (``RepeatFilter``), never a traceback per occurrence.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

logger = logging.getLogger(__name__)

# descriptors kept free of connections: log segments, checkpoints, model files, and one accept
# burst (asyncio accepts up to the listen backlog per turn of the loop, before evicted connections'
# sockets are closed): a burst must not run into the open-file limit
RESERVED_FILES = 128
ACCEPT_BACKLOG = 128
_BUSY_BODY = (
    b'{"error":{"message":"the server holds as many connections as it can; retry shortly",'
    b'"type":"server_error","param":null,"code":"busy"}}'
)
BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
    b"retry-after: 1\r\ncontent-length: %d\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY)
)


def raise_open_file_limit() -> tuple[int, int]:
    """Raise the soft open-file limit to the hard one; returns ``(soft, hard)`` as they are now."""
    try:
        import resource
    except ImportError:  # Windows
        return (8192, 8192)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 20
    if soft != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:
            logger.warning("could not raise the open-file limit from %d to %d: %s", soft, hard, exc)
    return (soft if soft != resource.RLIM_INFINITY else hard, hard)


def default_max_connections(open_files: int) -> int:
    return max(16, open_files - RESERVED_FILES - ACCEPT_BACKLOG)


class RepeatFilter(logging.Filter):
    """Lets the first record of each kind through, then one summary per ``every`` seconds with
    the count, without tracebacks. Kinds are the records' message templates."""

    def __init__(self, every: float = 60.0) -> None:
        super().__init__()
        self.every = every
        self._seen: dict[str, tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = str(record.msg)
        now = time.monotonic()
        last, count = self._seen.get(key, (0.0, 0))
        if last and now - last < self.every:
            self._seen[key] = (last, count + 1)
            return False
        self._seen[key] = (now, 0)
        if last:
            record.msg = f"{record.msg} (and {count} more like it in the last {now - last:.0f}s)"
            record.exc_info = record.exc_text = None
        return True


class Guards:
    """The connection limits, and what they did (counted for status and logs)."""

    def __init__(self, header_timeout: float, write_timeout: float, max_connections: int) -> None:
        self.header_timeout = header_timeout
        self.write_timeout = write_timeout
        self.max_connections = max_connections
        self.evicted = 0
        self.refused = 0
        self.header_timeouts = 0
        self.write_timeouts = 0
        # connections not in a request, longest idle first: who makes room for a new one (O(1))
        self.idle: OrderedDict[Any, None] = OrderedDict()


def guarded_protocol(guards: Guards) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with ``guards`` applied; pass it as ``uvicorn.Config(http=...)``."""
    return type("GuardedProtocol", (GuardedProtocol,), {"guards": guards})


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with ``guards`` applied (``guarded_protocol`` makes one class per ``Guards``)."""

    guards: Guards

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._headers_in = False  # a request's headers are complete and its answer is not (a request in progress)
        self._header_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        self.idle_since = time.monotonic()

    # -- the cap -----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.guards.max_connections and not self._make_room():
            self.guards.refused += 1
            logger.warning("connection refused: %d connections open, none idle", len(self.connections) - 1)
            transport.write(BUSY)
            transport.close()
            return
        self._arm_header_timer()

    def _make_room(self) -> bool:
        """Close the longest-idle connection (one not in a request: waiting for, or trickling
        in, its next request's headers)."""
        while self.guards.idle:
            oldest, _ = self.guards.idle.popitem(last=False)
            if oldest.transport.is_closing():
                continue
            self.guards.evicted += 1
            logger.warning(
                "at the connection limit (%d): closing the longest-idle connection", self.guards.max_connections
            )
            oldest.transport.close()
            return True
        return False

    def _now_idle(self) -> None:
        self.idle_since = time.monotonic()
        self.guards.idle[self] = None
        self.guards.idle.move_to_end(self)

    def _now_busy(self) -> None:
        self.guards.idle.pop(self, None)

    # -- headers -----------------------------------------------------------------------
    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._now_idle()
        self._header_timer = self.loop.call_later(self.guards.header_timeout, self._headers_too_slow)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if not self._headers_in and not self.transport.is_closing():
            self.guards.header_timeouts += 1
            logger.info("closing a connection that sent no complete request in %gs", self.guards.header_timeout)
            self.transport.close()

    def on_headers_complete(self) -> None:
        self._headers_in = True
        super().on_headers_complete()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)  # (this also stops uvicorn's keep-alive timer)
        if self._headers_in:
            self._cancel_header_timer()  # the headers are in; the body has its own deadline
            self._now_busy()
        elif self._header_timer is None and not self.transport.is_closing():
            self._arm_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # arms uvicorn's keep-alive timer, or starts a pipelined request
        self._headers_in = self.cycle is not None and not self.cycle.response_complete
        if not self.transport.is_closing() and not self._headers_in:
            self._now_idle()

    # -- readers that stop reading -------------------------------------------------------
    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.guards.write_timeout, self._reader_too_slow)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _reader_too_slow(self) -> None:
        self._write_timer = None
        self.guards.write_timeouts += 1
        logger.info("closing a connection that read nothing for %gs (its answer is dropped)", self.guards.write_timeout)
        self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        self._now_busy()  # (gone: no longer a candidate to make room)
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None
        super().connection_lost(exc)
