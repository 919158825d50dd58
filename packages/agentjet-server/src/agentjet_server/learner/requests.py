"""What the admin API asks of the learner thread: new settings, checkpoints, and other work (another
run's checkpoint to adopt), held here until the thread carries them out between two steps."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from agentjet_server.errors import StateError


class Requests:
    def __init__(self, wake: Callable[[], None]) -> None:
        self._wake = wake  # the learner thread may wait for a batch: wake it up
        self._lock = threading.Lock()
        self._config: Any = None
        self._checkpoints: list[Future[Any]] = []
        self._calls: list[tuple[Callable[[], Any], Future[Any]]] = []

    def reconfigure(self, config: Any) -> None:
        """New learner settings, taken before the next step (a later call replaces an earlier one)."""
        with self._lock:
            self._config = config

    def checkpoint(self) -> Future[Any]:
        """A checkpoint; requests that arrive before the thread looks share one."""
        future: Future[Any] = Future()
        with self._lock:
            self._checkpoints.append(future)
        self._wake()
        return future

    def call(self, work: Callable[[], Any]) -> Future[Any]:
        """``work`` run by the learner thread after the step in progress (at once when idle)."""
        future: Future[Any] = Future()
        with self._lock:
            self._calls.append((work, future))
        self._wake()
        return future

    def take(self) -> tuple[Any, list[Future[Any]], list[tuple[Callable[[], Any], Future[Any]]]]:
        """(learner thread) What was asked since it last looked: settings, checkpoints, work."""
        with self._lock:
            taken = self._config, self._checkpoints, self._calls
            self._config, self._checkpoints, self._calls = None, [], []
        return taken

    @staticmethod
    def run(calls: list[tuple[Callable[[], Any], Future[Any]]], stopping: bool = False) -> None:
        """(learner thread) Carry out ``calls``, each answered with its result or error (or, when the
        loop is stopping, with an error that says so)."""
        for work, future in calls:
            if stopping:
                future.set_exception(StateError("the server is stopping; the request was not carried out"))
                continue
            try:
                future.set_result(work())
            except Exception as exc:
                future.set_exception(exc)
