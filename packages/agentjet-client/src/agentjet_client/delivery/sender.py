"""Delivery: one ``Sender`` per server pushes what its spool holds to that server.

Every finished trajectory (with agents on several servers, each server's part of it, see
``SwarmClient.split``) is committed to its server's durable spool (``spool.Spool``) before the
runner moves on. The sender pushes the oldest spooled items in batches, waits with exponential
backoff and jitter while its server does not answer (cut short when a status poll finds it back:
``answering``), and removes an item only once the server has answered for it. Items an earlier run left
are sent first. Senders are independent: a server that does not answer holds back its own items only,
never another server's.

A full training buffer (429) is back-pressure, not an outage: the sender halves its batch at once (a
smaller one may fit the room that is left, and it may hold the members that groups waiting in the buffer
lack) and, at a batch of one, waits as long as the server's ``Retry-After`` says; each batch answered
doubles the next one again, up to the size the server takes at all (halved for good on a 413).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, wait_random_exponential

from agentjet_client.delivery.spool import GroupCommit, Spool, SpoolError
from agentjet_client.errors import AgentJetError, RejectedRequest, ServerBusy, ServerStarting
from agentjet_client.protocol import STARTING_RETRY_S, ClientReport, Trajectory, TrajectoryBatchResult

if TYPE_CHECKING:
    from agentjet_client.client import SwarmClient

logger = logging.getLogger(__name__)


def _resendable(exc: BaseException) -> bool:
    """A failed push worth repeating after a backoff: the server was down or erred (not one that refused the
    request, nor a full buffer, which the sender answers with a smaller batch)."""
    return isinstance(exc, AgentJetError) and not isinstance(exc, RejectedRequest | ServerBusy)


@dataclass
class DeliveryCounts:
    """What the servers answered for the trajectories of a run (or of a gateway), kept by its senders
    (one record for all of them); the run's report reads it."""

    accepted: int = 0  # answers to training episodes (with agents on several servers, one per server part)
    duplicate: int = 0
    rejected: int = 0
    reject_reasons: Counter[str] = field(default_factory=Counter)
    by_server: dict[str, Counter[str]] = field(default_factory=dict)  # server -> answers to training episodes
    last_version: int | None = None  # the policy version the default server's last answer named
    resent_leftovers: int = 0  # answered items a previous run had left in the spool
    spool_errors: int = 0  # failed spool writes (retried: the trajectory waits in memory)


class Sender:
    """One server's outbox: its spool, what this run put there, and the loop that delivers it."""

    def __init__(
        self,
        client: SwarmClient,
        server: str,
        spool: Spool,
        counts: DeliveryCounts,
        client_report: Callable[[Spool, int], ClientReport],
        *,
        batch: int = 256,
        backoff_max: float = 30.0,
    ) -> None:
        self.client = client
        self.server = server
        self.spool = spool
        self.tally = counts
        self.counts: Counter[str] = counts.by_server.setdefault(server, Counter())
        self.mine: set[str] = set()  # this run's items spooled here and not yet answered
        self.pending = 0  # training episodes started that this server has not answered yet
        self.pending_by_tag: Counter[str] = Counter()  # the same by task tag ('' for untagged)
        self._tags: dict[str, str] = {}  # tag of each training item in ``mine``
        self.version = 0  # the newest policy version this server told of
        self.failing = False  # the spool cannot be written (new episodes wait)
        self._evals: set[str] = set()  # evaluation episodes among ``mine``
        self._client_report = client_report
        self._limit = batch  # the most the server takes in one push (halved for good on a 413)
        self._batch = batch  # the next push's size (halved on a 429, doubled back after each answered push)
        self._backoff_max = backoff_max
        self._commits = GroupCommit(spool.put_many)
        self._spooled = asyncio.Event()
        self._answering = asyncio.Event()  # set when a status poll found the server answering

    def started(self, tag: str | None, count: int = 1) -> None:
        """``count`` training episodes of task ``tag`` started (negative: answered) for this server."""
        self.pending += count
        self.pending_by_tag[tag or ""] += count

    def wake(self) -> None:
        self._spooled.set()

    def answering(self) -> None:
        """The server answered a status poll: a push waiting out a backoff goes now."""
        self._answering.set()

    async def put(self, trajectory: Trajectory, evaluation: bool) -> None:
        """Commit ``trajectory`` to the spool (on disk before the runner goes on). While the spool
        cannot be written (disk full, read-only), keep it in memory and retry with backoff; the
        runner starts no new episode meanwhile (logged once per outage)."""
        retrying = AsyncRetrying(
            wait=wait_random_exponential(multiplier=0.25, max=self._backoff_max),
            retry=retry_if_exception(lambda exc: isinstance(exc, SpoolError)),
            before_sleep=self._spool_failed,
        )
        inserted = False
        async for attempt in retrying:
            with attempt:
                inserted = await self._commits.put(trajectory)
        if self.failing:
            logger.warning("the spool is writable again; episodes resume")
        self.failing = False
        if inserted:
            self.mine.add(trajectory.id)
            if evaluation:
                self._evals.add(trajectory.id)
            else:
                self._tags[trajectory.id] = trajectory.task_tag or ""
        elif not evaluation:  # the id is already spooled (cannot happen with fresh episode ids)
            self.started(trajectory.task_tag, -1)
        self._spooled.set()

    def _spool_failed(self, state: RetryCallState) -> None:
        self.tally.spool_errors += 1
        if not self.failing:
            exc = state.outcome.exception() if state.outcome else None
            logger.error(
                "cannot write the spool (%s); finished trajectories wait in memory and are retried, "
                "new episodes wait until it works again (free disk space or fix --spool-dir)",
                exc,
            )
        self.failing = True

    async def run(self) -> None:
        """Deliver until cancelled: the oldest spooled items, a batch at a time."""
        self._spooled = asyncio.Event()  # of the running event loop (a runner may run more than once)
        self._answering = asyncio.Event()
        while True:
            self._spooled.clear()  # before looking, so that an item spooled while we look still wakes the wait
            batch = await asyncio.to_thread(self.spool.peek, self._batch)
            if self.spool.unreadable:  # no server could take these: rejected here, not resent forever
                for item_id, why in self.spool.unreadable:
                    logger.error("spooled item %s is not a valid trajectory and cannot be sent: %s", item_id, why)
                    self.tally.reject_reasons["not a valid trajectory (in the spool)"] += 1
                await self._settle({item_id: "rejected" for item_id, _ in self.spool.unreadable})
                await asyncio.to_thread(self.spool.note_error, "unreadable spooled items were settled as rejected")
            if not batch:
                await self._spooled.wait()
                await asyncio.sleep(0.05)  # let siblings that finish together travel together
                continue
            ids = [item_id for item_id, _ in batch]
            await asyncio.to_thread(self.spool.mark_sent, ids)
            try:
                answer = await self._push([t for _, t in batch])
            except ServerBusy as exc:  # its buffer has no room for this many now: fewer may fit, else wait
                if len(batch) > 1:
                    self._batch = max(1, len(batch) // 2)
                else:
                    await asyncio.sleep(min(exc.retry_after or 1.0, self._backoff_max))
                continue
            except RejectedRequest as exc:  # the server refused the request itself: resending cannot help
                if exc.status_code == 413 and len(batch) > 1:  # too many at once for its buffer: send fewer
                    self._limit = self._batch = max(1, len(batch) // 2)
                    logger.warning("%s takes at most %d trajectories per push; sending fewer", self.server, self._batch)
                    continue
                logger.error("%s refused a batch of %d trajectories: %s", self.server, len(batch), exc.message)
                self.tally.reject_reasons[exc.message] += len(batch)
                await self._settle({item_id: "rejected" for item_id in ids})
                await asyncio.to_thread(self.spool.note_error, exc.message[:500])
                continue
            self._batch = min(self._limit, 2 * self._batch)
            self.version = max(self.version, answer.policy_version)
            if self.server == self.client.server_url:
                self.tally.last_version = answer.policy_version
            answers: dict[str, str] = {}
            for item_id, result in zip(ids, answer.results, strict=True):
                answers[item_id] = result.status
                if result.status == "rejected":
                    self.tally.reject_reasons[result.reason or ""] += 1
            await self._settle(answers)

    async def _push(self, trajectories: list[Trajectory]) -> TrajectoryBatchResult:
        """Submit, and while the server does not answer, wait (backoff with jitter; a server that says it is
        starting, as long as it says; either cut short by ``answering``) and submit again."""
        backoff = wait_random_exponential(multiplier=0.5, max=self._backoff_max)

        def wait(state: RetryCallState) -> float:
            starting = state.outcome is not None and isinstance(state.outcome.exception(), ServerStarting)
            return min(float(STARTING_RETRY_S), self._backoff_max) if starting else backoff(state)

        retrying = AsyncRetrying(
            wait=wait,
            sleep=self._sleep_unless_answering,
            retry=retry_if_exception(_resendable),
            before_sleep=functools.partial(self._push_failed, count=len(trajectories)),
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                return await asyncio.to_thread(self._submit, trajectories)
        raise AssertionError("unreachable: AsyncRetrying retries until it returns or re-raises")

    async def _sleep_unless_answering(self, seconds: float) -> None:
        self._answering.clear()
        try:
            await asyncio.wait_for(self._answering.wait(), seconds)
        except TimeoutError:
            pass

    async def _push_failed(self, state: RetryCallState, count: int) -> None:
        exc = state.outcome.exception() if state.outcome else None
        delay = state.upcoming_sleep
        logger.warning("submit to %s failed (%s); %d stay spooled, retrying in %.1fs", self.server, exc, count, delay)
        await asyncio.to_thread(self.spool.note_error, str(exc)[:500])

    def _submit(self, trajectories: list[Trajectory]) -> TrajectoryBatchResult:
        """Push with the run's report (which counts the spool: a query, so in the sender's thread)."""
        report = self._client_report(self.spool, len(trajectories))
        return self.client.submit_to(self.server, trajectories, report, retry=False)  # the backoff is ours

    async def _settle(self, answers: dict[str, str]) -> None:
        await asyncio.to_thread(self.spool.settle, answers)
        for item_id, status in answers.items():
            evaluation = item_id in self._evals
            if not evaluation:  # evaluation episodes are counted apart (``evaluated``)
                self.counts[status] += 1
                if status == "accepted":
                    self.tally.accepted += 1
            if status == "duplicate":
                self.tally.duplicate += 1
            elif status != "accepted":
                self.tally.rejected += 1
            if item_id in self.mine:
                self.mine.discard(item_id)
                if evaluation:
                    self._evals.discard(item_id)
                else:
                    self.started(self._tags.pop(item_id, None), -1)
            else:
                self.tally.resent_leftovers += 1
