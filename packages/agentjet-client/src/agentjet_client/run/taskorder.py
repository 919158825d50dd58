"""The order a run plays a code dir's tasks in, and where it stands, kept with the spool.

Position ``p`` of the order is one GRPO group. An epoch is every task ``repeats`` times; each epoch is
shuffled with a generator seeded by ``(seed, epoch)`` (or kept in the source's order without
``shuffle``); with ``epochs`` the order ends after that many, else it goes on. Tasks are read again
at the start of each epoch (a callable may make new ones, a file may have been edited).

Every group's start is noted in the spool of the run's first server (``Spool.open_group``) with the
episodes it needs; the transaction that commits one of its trajectories to that spool counts it, and
the group closes when all are there. A run restarted with the same spool (same server, same
``--spool-dir``) continues the order: first the groups the killed run left open, each with only the
episodes it still lacks and under its own group id (so they join the episodes already pushed), then
the next position. Nothing is skipped and nothing played twice. Without ``--seed`` the first run draws
one and the spool keeps it; a different ``--seed``, other repeats or shuffling, or a task source that
now gives other tasks, starts the order afresh (and says so).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from agentjet_client.delivery.spool import Spool, SpoolError
from agentjet_client.run.config import RunConfig
from agentjet_client.run.report import RunReport
from agentjet_client.run.rollout import Rollouts
from agentjet_client.run.tracks import Track
from agentjet_client.tasks.sources import Task

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class Planned:
    """The next group to start: the task at ``position`` of the order, ``episodes`` of it (None: a whole
    group) under ``group_id`` (None: a new one)."""

    position: int
    task_id: str
    task: Task
    group_id: str | None = None
    episodes: int | None = None


def fingerprint(ids: list[str], repeats: int, shuffle: bool) -> str:
    digest = hashlib.sha256(f"{repeats}:{shuffle}".encode())
    for task_id in ids:
        digest.update(b"\0" + task_id.encode())
    return digest.hexdigest()[:16]


class TaskOrder:
    """One code dir's order of groups (see the module docstring); ``next`` blocks while it reads tasks."""

    def __init__(
        self,
        load: Callable[[], list[tuple[str, Task]]],
        track: str,
        *,
        spool: Spool | None = None,
        seed: int | None = None,
        epochs: int = 0,
        repeats: int = 1,
        shuffle: bool = True,
    ) -> None:
        if repeats < 1 or epochs < 0:
            raise ValueError("repeats must be at least 1 and epochs at least 0 (0: no end)")
        self._load, self.track, self.spool = load, track, spool
        self._seed, self.epochs, self.repeats, self.shuffle = seed, epochs, repeats, shuffle
        self.position = 0
        self.resumed = 0  # groups a killed run left open, restarted by this run
        self._epoch: int | None = None
        self._tasks: list[tuple[str, Task]] = []
        self._order: list[int] = []
        self._pending: list[Planned] = []
        self._started = False
        self.continued: str | None = None  # what ``_start`` found: an order a stopped run left, continued

    @property
    def seed(self) -> int:
        if self._seed is None:
            self._seed = random.SystemRandom().randrange(2**31)
        return self._seed

    def _read_epoch(self, epoch: int) -> None:
        if self._epoch == epoch:
            return
        tasks = self._load()
        order = [index for index in range(len(tasks)) for _ in range(self.repeats)]
        if self.shuffle:
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
        self._epoch, self._tasks, self._order = epoch, tasks, order

    def _at(self, position: int) -> tuple[str, Task]:
        per_epoch = len(self._order) if self._epoch is not None else 0
        if not per_epoch:
            self._read_epoch(0)
            per_epoch = len(self._order)
        self._read_epoch(position // per_epoch)
        return self._tasks[self._order[position % len(self._order)]]

    def _start(self) -> None:
        """Where the spool says the last run stood, if it played the same order."""
        given = self._seed
        stored = self.spool.task_order(self.track) if self.spool is not None else None
        if stored is not None and given is None:
            self._seed = stored[1]
        self._read_epoch(0)
        mark = fingerprint([task_id for task_id, _ in self._tasks], self.repeats, self.shuffle)
        if stored is not None and stored[0] == mark and (given is None or given == stored[1]):
            self.position = stored[2]
            assert self.spool is not None
            for position, group_id, task_id, missing in self.spool.open_groups(self.track):
                found_id, task = self._at(position)
                if found_id == task_id and missing > 0:
                    self._pending.append(Planned(position, task_id, task, group_id, missing))
            self.resumed, self._started = len(self._pending), True
            if self._pending:  # a run stopped (killed, Ctrl-C) with groups open
                self.continued = (
                    f"finished {self.resumed} groups a stopped run left open in the spool, then went on with its "
                    f"task order from group {self.position}"
                )
            elif self.position:  # the last run ended (or stopped) between groups
                self.continued = (
                    f"the task order went on from group {self.position}, where the last run with this spool left "
                    "it (a new --seed or --spool-dir starts it afresh)"
                )
            if self.continued:
                logger.info("%s (%s)", self.continued, self.track)
            return
        if stored is not None:
            logger.warning(
                "the tasks, --seed, --repeats or shuffling of %s changed since the last run with this spool: "
                "its task order starts afresh",
                self.track,
            )
        if self.spool is not None:
            self.spool.start_task_order(self.track, mark, self.seed)
        self._started = True

    def next(self) -> Planned | None:
        """The next group to start (None once ``epochs`` are done); noted in the spool as started."""
        if not self._started:
            self._start()
        if self._pending:
            return self._pending.pop(0)
        if self.epochs and self._order and self.position >= self.epochs * len(self._order):
            return None
        task_id, task = self._at(self.position)
        planned = Planned(self.position, task_id, task)
        self.position += 1
        return planned

    def passed_over(self, planned: Planned) -> None:
        """Note in the spool that ``planned`` (a new group) is not played (dynamic sampling)."""
        if self.spool is not None and planned.group_id is None:
            self.spool.pass_over(self.track, planned.position)

    def opened(self, planned: Planned, group_id: str, size: int) -> None:
        """Note in the spool that ``planned`` (a new group) starts as ``group_id`` with ``size`` episodes."""
        if self.spool is not None and planned.group_id is None:
            self.spool.open_group(self.track, planned.position, group_id, planned.task_id, size)


class GroupStarts:
    """The task orders of a run's code dirs (tracks), and the start of each one's next group: noted in
    the spool, then launched by ``Rollouts``. A spool that cannot be written holds the start back and is
    tried again (as a full spool holds new episodes back)."""

    def __init__(
        self,
        tracks: Sequence[Track],
        rollouts: Rollouts,
        report: RunReport,
        spool: Spool | None,
        stopped: Callable[[], bool],
        config: RunConfig,
    ) -> None:
        self.tracks, self.rollouts, self.report, self._stopped = tracks, rollouts, report, stopped
        self._pause = (config.poll_interval, config.backoff_max)
        self.dynamic = config.dynamic_sampling  # pass over tasks whose recent groups were all tied (``sampling``)
        self.orders = [
            TaskOrder(
                track.load_tasks,
                f"{index}:{track.agent.name}",
                spool=spool,
                seed=None if config.seed is None else config.seed + index,
                epochs=config.epochs,
                repeats=config.repeats,
                shuffle=config.shuffle,
            )
            for index, track in enumerate(tracks)
        ]

    async def next_group(self, index: int, label: str, size: int) -> bool:
        """Start the next group of track ``index`` (``size`` episodes, or what an unfinished one of a stopped
        run lacks); False once its order has ended or the run stops."""
        track, order = self.tracks[index], self.orders[index]
        first = order.position == 0 and order.continued is None
        planned = await self._spool_write(order.next)  # reads tasks (another interpreter may load them)
        if first and order.continued is not None:
            self.report.notes.append(order.continued + (f" ({track.agent.name})" if len(self.tracks) > 1 else ""))
        while self.dynamic and planned is not None and planned.group_id is None:
            if not self.report.tasks.skip(planned.task_id):
                break
            await self._spool_write(order.passed_over, planned)
            planned = await self._spool_write(order.next)
        if planned is None or self._stopped():
            return False
        group_id = planned.group_id or self.rollouts.group_id(planned.task_id, label)
        await self._spool_write(order.opened, planned, group_id, size)
        self.rollouts.start_group(track, (planned.task_id, planned.task), group_id, planned.episodes or size, size)
        return True

    async def _spool_write(self, fn: Callable[..., T], *args: Any) -> T | None:
        """``fn(*args)`` in a thread, retried while the spool cannot be written (None if the run stops)."""
        pause, longest = self._pause
        while not self._stopped():
            try:
                return await asyncio.to_thread(fn, *args)
            except SpoolError as exc:
                self.report.order_errors += 1
                logger.warning("cannot note the next group in the spool (%s); retrying in %.1fs", exc, pause)
                await asyncio.sleep(pause)
                pause = min(pause * 2, longest)
        return None
