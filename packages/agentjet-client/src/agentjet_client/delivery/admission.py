"""Admission: start episodes only while every server the run uses has room for them.

Each server says in ``/v1/status`` how many more episodes it can take before training catches up
(``admission_budget``: what keeps rollouts within the staleness bound), and under a task mix
(``agentjet-server up --mix math=3,tools=1``) how many of each task tag (``by_tag``): a run asks
for the budget of its agent's tag (of each of its code dirs' tags, and starts a group of the one
with the most room). A group of episodes
starts when, on every one of the run's servers, the budget less this run's episodes still
unanswered there covers the group (or nothing of this run is outstanding there and the budget is
positive). While a server does not answer, new episodes wait (polled with exponential backoff and
jitter): started now they could only fail. What already finished keeps going out (``delivery``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, wait_random_exponential

from agentjet_client.errors import AgentJetError, RejectedRequest, ServerError, ServerStarting, ServerUnreachable
from agentjet_client.protocol import STARTING_RETRY_S, ServerStatus

if TYPE_CHECKING:
    from agentjet_client.client import SwarmClient
    from agentjet_client.delivery.sender import Sender

logger = logging.getLogger(__name__)


def _down(exc: BaseException) -> bool:
    """The server is down or restarting (as opposed to answering, but not as an AgentJet server would)."""
    return isinstance(exc, ServerUnreachable | ServerError) and not isinstance(exc, RejectedRequest)


@dataclass
class AdmissionCounts:
    """What admission saw of the servers, kept for the run's report."""

    first_version: int | None = None  # the default server's policy version at the first status
    waits_for_server: int = 0  # status polls that found a server down (episodes held back meanwhile)


class Admission:
    def __init__(
        self,
        client: SwarmClient,
        senders: dict[str, Sender],
        counts: AdmissionCounts,
        stopped: Callable[[], bool],
        *,
        enabled: bool = True,
        poll_interval: float = 0.2,
        backoff_max: float = 30.0,
    ) -> None:
        self.client = client
        self.senders = senders
        self.seen = counts
        self.enabled = enabled
        self._stopped = stopped
        self._poll = poll_interval
        self._backoff_max = backoff_max
        self._down: set[str] = set()  # servers that did not answer the last poll (logged once per outage)
        self._warned_full = False
        self.group_size: int | None = None  # the default server's, as its last status said

    async def status(self, server: str) -> ServerStatus | None:
        """The server's status, waiting (backoff with jitter) while it is down; None if the run
        stops meanwhile. Raises what is not an outage (a 4xx: not an AgentJet server, a bad key)."""
        backoff = wait_random_exponential(multiplier=0.25, max=self._backoff_max)

        def wait(state: RetryCallState) -> float:
            # a server that says it is starting says when to ask again
            starting = state.outcome is not None and isinstance(state.outcome.exception(), ServerStarting)
            return min(float(STARTING_RETRY_S), self._backoff_max) if starting else backoff(state)

        retrying = AsyncRetrying(
            wait=wait,
            retry=retry_if_exception(_down),
            before_sleep=lambda state: self._waiting(server, state),
            reraise=True,
        )
        status: ServerStatus | None = None
        async for attempt in retrying:
            with attempt:
                if self._stopped():
                    return None
                status = await asyncio.to_thread(self.client.status, server)
        assert status is not None
        if server in self._down:
            self._down.discard(server)
            self.senders[server].answering()  # its spooled items go now, not at the end of a backoff
            logger.warning("server %s is back (policy v%d); starting episodes again", server, status.policy_version)
        if server == self.client.server_url:
            if self.seen.first_version is None:
                self.seen.first_version = status.policy_version
            self._note_group_size(status.learner.group_size)
        sender = self.senders[server]
        sender.version = max(sender.version, status.policy_version)
        return status

    def _note_group_size(self, size: int) -> None:
        if self.group_size is not None and size != self.group_size:
            logger.warning(
                "the server's group size changed from %d to %d (an admin's change): new groups have %d episodes",
                self.group_size,
                size,
                size,
            )
        self.group_size = size

    def _waiting(self, server: str, state: RetryCallState) -> None:
        self.seen.waits_for_server += 1
        if server not in self._down:
            self._down.add(server)
            exc = state.outcome.exception() if state.outcome else None
            logger.warning("server %s unavailable (%s); new episodes wait until it answers", server, exc)

    async def spool_room(self) -> None:
        """Return once every server's spool can take more (no new work while finished work can't be
        kept: a spool that fails to write, or one at its bound, holds new episodes back; nothing is dropped)."""
        senders = list(self.senders.values())
        while not self._stopped() and any(sender.failing for sender in senders):
            await asyncio.sleep(self._poll * 5)
        while not self._stopped():
            full = await asyncio.to_thread(lambda: [s for s in senders if s.spool.full])
            if not full:
                break
            if not self._warned_full:
                logger.warning(
                    "the spool of %s holds %d trajectories (its bound); no new episodes start until the server "
                    "has taken some (nothing is dropped)",
                    full[0].server,
                    full[0].spool.max_items,
                )
                self._warned_full = True
            await asyncio.sleep(self._poll * 5)
        self._warned_full = False

    async def drained(self, tasks: list[asyncio.Task[None]]) -> None:
        """Wait until the servers have answered every trajectory this run spooled (raising what killed a
        sender in ``tasks``, if one died: the spool keeps its items)."""
        announced = False
        while (unanswered := sum(len(sender.mine) for sender in self.senders.values())) and not self._stopped():
            for task in tasks:
                if task.done():
                    task.result()
            if not announced:
                logger.info("waiting for the servers to answer %d spooled trajectories", unanswered)
                announced = True
            for sender in self.senders.values():
                sender.wake()
            await asyncio.sleep(0.05)

    async def wait(self, need: int, tag: str | None = None) -> None:
        """Return once every server has room for ``need`` more episodes of this run, of task
        ``tag`` (at once if admission is off, or the run stops)."""
        await self.choose(need, [tag])

    async def choose(self, need: int, tags: list[str | None]) -> dict[int, int]:
        """Wait until every server has room for ``need`` more episodes of at least one of ``tags``;
        return ``{index in tags: room}`` for those that have (room: the least, over the servers, of
        the tag's budget less this run's unanswered episodes of it). Every index, with room 0, if
        admission is off; empty if the run stops."""
        if not self.enabled:
            return dict.fromkeys(range(len(tags)), 0)
        while not self._stopped():
            room: dict[int, int] = dict.fromkeys(range(len(tags)), 1 << 30)
            for server, sender in self.senders.items():
                try:
                    status = await self.status(server)
                except AgentJetError as exc:  # it answers, but not as an AgentJet server would
                    logger.warning("could not read the status of %s for admission (%s); starting anyway", server, exc)
                    continue
                if status is None:
                    return {}
                if not _fits(status.admission_budget, sender.pending, need):
                    room.clear()
                    break
                for index in list(room):
                    tag = tags[index]
                    budget, pending = status.budget_for(tag), sender.pending_by_tag[tag or ""]
                    if _fits(budget, pending, need):
                        room[index] = min(room[index], budget - pending)
                    else:
                        del room[index]
            if room:
                return room
            await asyncio.sleep(self._poll)
        return {}


def _fits(budget: int, pending: int, need: int) -> bool:
    """Room for ``need`` more: the budget covers them on top of what is outstanding, or nothing is
    outstanding and the budget is positive (a group larger than the budget still starts, alone)."""
    return budget - pending >= need or (pending == 0 and budget > 0)
