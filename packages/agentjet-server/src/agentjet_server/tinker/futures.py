"""The Tinker API's futures: every operation answers at once with a request id and runs on the workbench's
thread; ``retrieve_future`` answers ``try_again`` while it runs (after waiting up to ``POLL_WAIT_S`` for it,
so a client's polling costs little), then its result, or its error with a category ("user" for what the
request got wrong). A finished future is kept ``KEEP_S`` seconds (a client retries a lost answer within
that); an unknown or expired one is a 404. At most ``LIMIT`` futures are kept: the oldest finished go first,
and a server with ``LIMIT`` still running refuses new work with a 429 (the SDK backs off and retries).
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from agentjet_server.errors import RateLimitError

KEEP_S = 600.0
POLL_WAIT_S = 10.0
LIMIT = 20_000


@dataclass
class Future:
    kind: str
    created: float = field(default_factory=time.monotonic)
    done: bool = False
    result: Any = None  # what the route renders (protobuf or JSON, as the client asks)
    error: str | None = None
    category: str = "user"
    finished: float | None = None
    waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = field(default_factory=list)


class Futures:
    def __init__(self, keep_s: float = KEEP_S, limit: int = LIMIT) -> None:
        self.keep_s, self.limit = keep_s, limit
        self._items: OrderedDict[str, Future] = OrderedDict()
        self._lock = threading.Lock()

    def create(self, kind: str) -> str:
        with self._lock:
            self._sweep()
            if len(self._items) >= self.limit:
                raise RateLimitError(
                    f"{self.limit} Tinker operations are waiting to run or to be retrieved; retry later",
                    retry_after=5.0,
                )
            request_id = f"{kind.lower()}-{uuid.uuid4().hex}"
            self._items[request_id] = Future(kind)
            return request_id

    def finish(self, request_id: str, result: Any = None, error: str | None = None, category: str = "user") -> None:
        with self._lock:
            future = self._items.get(request_id)
            if future is None:
                return
            future.done, future.result, future.error, future.category = True, result, error, category
            future.finished = time.monotonic()
            waiters, future.waiters = future.waiters, []
        for loop, event in waiters:
            loop.call_soon_threadsafe(event.set)

    def get(self, request_id: str) -> Future | None:
        with self._lock:
            self._sweep()
            return self._items.get(request_id)

    async def wait(self, request_id: str, timeout: float = POLL_WAIT_S) -> Future | None:
        """The future once it is done, or as it is after ``timeout`` seconds (None: unknown or expired)."""
        event = asyncio.Event()
        with self._lock:
            future = self._items.get(request_id)
            if future is None or future.done:
                return future
            future.waiters.append((asyncio.get_running_loop(), event))
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except TimeoutError:
            pass
        return self.get(request_id)

    def _sweep(self) -> None:
        now = time.monotonic()
        stale = [k for k, f in self._items.items() if f.finished is not None and now - f.finished > self.keep_s]
        for key in stale:
            del self._items[key]
        if len(self._items) >= self.limit:  # the oldest finished make room
            for key in [k for k, f in self._items.items() if f.done][: len(self._items) - self.limit + 1]:
                del self._items[key]
