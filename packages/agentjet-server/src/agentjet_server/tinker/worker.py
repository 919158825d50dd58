"""The workbench's one thread: operations run in the order they arrived, each finishing its future; sample
requests that wait with the same sampler, prompt and settings (and no seed of their own) run as one batch,
which is what a cookbook's groups of one-sequence samples of one prompt become."""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from typing import Any

from agentjet_server.errors import RequestError
from agentjet_server.tinker.futures import Futures
from agentjet_server.tinker.sampling import MAX_ROWS, SampleJob, merge_key

logger = logging.getLogger(__name__)

Work = Callable[[], Any] | SampleJob
Job = tuple[str, Work]


class Worker:
    def __init__(self, futures: Futures, run_samples: Callable[[list[SampleJob]], list[Any]]) -> None:
        self.futures, self.run_samples = futures, run_samples
        self._jobs: collections.deque[Job] = collections.deque()
        self._ready = threading.Condition()
        self._closing = False
        self._thread: threading.Thread | None = None

    def submit(self, request_id: str, work: Work) -> str:
        with self._ready:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="agentjet-tinker", daemon=True)
                self._thread.start()
            self._jobs.append((request_id, work))
            self._ready.notify()
        return request_id

    def _next(self) -> list[Job] | None:
        """The next job, with the waiting sample requests it can share a batch with (same sampler, prompt and
        settings, no seed of their own): what many clients' one-sequence samples of one prompt become."""
        with self._ready:
            while not self._jobs and not self._closing:
                self._ready.wait()
            if not self._jobs:
                return None
            first = self._jobs.popleft()
            lead = first[1]
            key = merge_key(lead) if isinstance(lead, SampleJob) else None
            if key is None or not isinstance(lead, SampleJob):
                return [first]
            same = [j for j in self._jobs if isinstance(j[1], SampleJob) and merge_key(j[1]) == key]
            same = same[: max(0, MAX_ROWS // max(lead.ask.num_samples, 1) - 1)]
            for job in same:
                self._jobs.remove(job)
            return [first, *same]

    def _run(self) -> None:
        while (jobs := self._next()) is not None:
            try:
                works = [work for _, work in jobs]
                samples = [w for w in works if isinstance(w, SampleJob)]
                results = self.run_samples(samples) if samples else [works[0]()]  # type: ignore[operator]
                for (request_id, _), result in zip(jobs, results, strict=True):
                    self.futures.finish(request_id, result)
            except RequestError as exc:
                for request_id, _ in jobs:
                    self.futures.finish(request_id, error=str(exc), category="user")
            except Exception as exc:  # the client gets the reason; the server goes on
                logger.exception("Tinker operation %s failed", jobs[0][0])
                for request_id, _ in jobs:
                    self.futures.finish(request_id, error=f"{type(exc).__name__}: {exc}", category="server")

    def close(self) -> None:
        with self._ready:
            self._closing = True
            self._ready.notify()
        if self._thread is not None:
            self._thread.join(timeout=10)
