"""How an engine thread and its callers hand things over: token streams and weight updates.

Both engines own their model in one thread. Callers on asyncio loops receive tokens through a
``TokenStream`` (the engine thread pushes with ``call_soon_threadsafe``); the learner's thread
offers new weights through a ``WeightSlot`` and blocks until the engine thread has applied them
between two steps. Only the newest offered weights matter: a newer offer supersedes an older one
that the engine has not taken yet.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncGenerator, Callable, Mapping
from dataclasses import dataclass, field

import torch

from agentjet_server.engine.base import TokenEvent
from agentjet_server.errors import EngineError


@dataclass
class TokenStream:
    """The caller's end of one generation: events arrive on the caller's loop."""

    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[TokenEvent | BaseException]
    cancelled: bool = False

    def push(self, item: TokenEvent | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the caller's loop is gone: nobody is listening any more
            self.cancelled = True

    async def until_finished(self, abandoned: Callable[[], None] | None = None) -> AsyncGenerator[TokenEvent]:
        """Each token as it arrives, through the one with a finish reason; engine errors are raised.

        If it ends before the finishing token (the caller went away, or the engine failed), the stream is
        marked ``cancelled`` and ``abandoned`` runs, for the engine to free the request's place. Iterate
        it under ``contextlib.aclosing`` so that this happens when the caller goes, not when the
        generator is collected."""
        finished = False
        try:
            while True:
                item = await self.events.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finish_reason is not None
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.cancelled = True
                if abandoned is not None:
                    abandoned()


@dataclass
class WeightUpdate:
    state_dict: Mapping[str, torch.Tensor]
    version: int
    applied: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    adapter: str | None = None  # an adapter per agent: the adapter these weights are (at its own version)


class WeightSlot:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: WeightUpdate | None = None

    def offer(
        self,
        state_dict: Mapping[str, torch.Tensor],
        version: int,
        wake: Callable[[], None],
        closed: threading.Event,
        adapter: str | None = None,
    ) -> None:
        """Leave weights (of ``adapter``, with an adapter per agent) for the engine thread and wait until they
        are live (or superseded by newer weights of the same adapter)."""
        update = WeightUpdate(state_dict, version, adapter=adapter)
        while True:
            with self._lock:
                pending = self._pending
                if pending is None or pending.adapter == adapter:
                    if pending is not None:
                        pending.applied.set()  # superseded: the newer weights win
                    self._pending = update
                    break
            wake()  # another adapter's weights wait: they go first
            if not pending.applied.wait(0.5) and closed.is_set():
                raise EngineError("the engine shut down before the weights were loaded")
        wake()
        while not update.applied.wait(0.5):
            if closed.is_set():
                raise EngineError("the engine shut down before the weights were loaded")
        if update.error is not None:
            raise EngineError(f"loading weights v{version} failed: {update.error}") from update.error

    def take(self) -> WeightUpdate | None:
        """For the engine thread: the weights to apply now, if any. Set ``applied`` when done."""
        with self._lock:
            update, self._pending = self._pending, None
        return update
