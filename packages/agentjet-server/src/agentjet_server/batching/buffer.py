"""Groups accepted trajectories by task id until batches of complete GRPO groups are ready.

A group is complete when ``group_size`` trajectories of one task id have arrived (failed or
truncated ones count towards completion, so a crashed sibling never holds a group open; the
learner trains only the complete ones). Further trajectories of the same task id open a new
group. Complete groups are trained first-in, first-out, ``batch_groups`` at a time.

A group whose siblings never all arrive (a client that stopped, a task id used once) is closed
``group_timeout`` seconds after it opened and trained as a smaller group: its members were
acknowledged, so they are trained, not dropped; GRPO's group-normalised advantage is defined for
any group of two or more (a group of one carries no signal and is consumed without a gradient).
A sibling the server rejected (stale, invalid) will never arrive either: ``add_absent`` counts it
towards its group's completion, so at high staleness a group closes when its last sibling is
answered instead of waiting ``group_timeout``.
``aged_out`` counts such groups. The buffer's size (``buffered`` trajectories, ``bytes`` of their
approximate memory) is what the store's admission limit checks before acknowledging more.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from agentjet_client.protocol import Trajectory


def footprint(trajectory: Trajectory) -> int:
    """Approximate bytes a buffered trajectory holds in memory: Python ints and floats for every
    token id, log-prob and version, and the text of the request messages."""
    numbers = sum(len(t.prompt_token_ids) + 3 * len(t.completion_token_ids) for t in trajectory.turns)
    text = sum(len(str(m.get("content") or "")) for t in trajectory.turns for m in t.request_messages)
    return 1024 + 36 * numbers + 2 * text


class GroupBuffer:
    def __init__(
        self,
        group_size: int,
        batch_groups: int,
        group_timeout: float = float("inf"),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if group_size < 1 or batch_groups < 1:
            raise ValueError("group_size and batch_groups must be at least 1")
        self.group_size = group_size
        self.batch_groups = batch_groups
        self.group_timeout = group_timeout
        self._clock = clock
        self._opened: dict[str, float] = {}  # when each open group got its first trajectory
        self._absent: dict[str, int] = {}  # siblings of an open group that were rejected
        self.aged_out = 0
        self.bytes = 0
        # each entry is (log sequence number, trajectory); the numbers let a checkpoint name them
        self._open: OrderedDict[str, list[tuple[int, Trajectory]]] = OrderedDict()
        self._ready: deque[list[tuple[int, Trajectory]]] = deque()
        self._taken: list[list[tuple[int, Trajectory]]] = []  # the batch the learner is training on
        self._cond = threading.Condition()
        self._woken = False  # ``wake`` was called: the learner's wait ends at once, batch or not

    def add(self, trajectory: Trajectory, lsn: int = -1) -> None:
        with self._cond:
            if trajectory.task_id not in self._open:
                self._opened[trajectory.task_id] = self._clock()
            group = self._open.setdefault(trajectory.task_id, [])
            group.append((lsn, trajectory))
            self.bytes += footprint(trajectory)
            if len(group) + self._absent.get(trajectory.task_id, 0) >= self.group_size:
                self._close(trajectory.task_id)

    def add_absent(self, task_id: str) -> None:
        """A trajectory of group ``task_id`` was rejected: count it towards the group's completion."""
        with self._cond:
            if task_id not in self._open:
                self._opened[task_id] = self._clock()
                self._open[task_id] = []
            self._absent[task_id] = self._absent.get(task_id, 0) + 1
            if len(self._open[task_id]) + self._absent[task_id] >= self.group_size:
                self._close(task_id)

    def _close(self, task_id: str) -> None:
        group = self._open.pop(task_id)
        del self._opened[task_id]
        self._absent.pop(task_id, None)
        if not group:  # every sibling was rejected: nothing to train
            return
        self._ready.append(group)
        if len(self._ready) >= self.batch_groups:
            self._cond.notify_all()

    def _age_out(self) -> None:
        """Close open groups older than ``group_timeout`` (oldest first: the dict keeps opening order)."""
        cutoff = self._clock() - self.group_timeout
        for task_id in [t for t, opened in self._opened.items() if opened <= cutoff]:
            self.aged_out += 1
            self._close(task_id)

    def take_batch(self, timeout: float | None = None) -> list[list[Trajectory]] | None:
        """Wait up to ``timeout`` seconds for ``batch_groups`` complete groups and take them. They
        stay in snapshots until ``commit`` (trained) or go back to the front with ``put_back``."""
        with self._cond:
            self._age_out()
            self._cond.wait_for(lambda: len(self._ready) >= self.batch_groups or self._woken, timeout=timeout)
            self._woken = False
            if len(self._ready) < self.batch_groups:
                return None
            if self._taken:
                raise RuntimeError("the batch taken before was neither committed nor put back")
            self._taken = [self._ready.popleft() for _ in range(self.batch_groups)]
            return [[t for _, t in group] for group in self._taken]

    def commit(self) -> None:
        """The batch last taken is trained (or deliberately skipped): forget it."""
        with self._cond:
            self.bytes -= sum(footprint(t) for group in self._taken for _, t in group)
            self._taken = []

    def put_back(self) -> None:
        """The batch last taken was not trained: it goes back to the front, to be taken next."""
        with self._cond:
            self._ready.extendleft(reversed(self._taken))
            self._taken = []

    def buffered_by_tag(self) -> Counter[str]:
        """``buffered`` by task tag ('' for untagged)."""
        with self._cond:
            groups = (*self._ready, *self._open.values())
            return Counter(t.task_tag or "" for group in groups for _, t in group)

    def snapshot(self) -> BufferSnapshot:
        """The log sequence numbers of everything buffered, in buffer order (for a checkpoint)."""
        with self._cond:
            return BufferSnapshot(
                ready=[[n for n, _ in group] for group in (*self._taken, *self._ready)],
                open=[[n for n, _ in group] for group in self._open.values() if group],
            )

    def resize(self, group_size: int, batch_groups: int, group_timeout: float) -> None:
        """New sizes from now on (the admin API): open groups that already hold ``group_size``
        trajectories close; a batch takes ``batch_groups`` groups from the next one on."""
        if group_size < 1 or batch_groups < 1:
            raise ValueError("group_size and batch_groups must be at least 1")
        with self._cond:
            self.group_size, self.batch_groups, self.group_timeout = group_size, batch_groups, group_timeout
            for task_id in [t for t, g in self._open.items() if len(g) + self._absent.get(t, 0) >= group_size]:
                self._close(task_id)
            self._cond.notify_all()

    @property
    def groups(self) -> tuple[int, int]:
        """``(complete groups waiting, open groups)``."""
        with self._cond:
            return len(self._ready), len(self._open)

    def wake(self) -> None:
        """End the learner's wait in ``take_batch`` now (it has work besides a batch: an admin request)."""
        with self._cond:
            self._woken = True
            self._cond.notify_all()

    @property
    def buffered(self) -> int:
        """Trajectories waiting to be trained (in open and complete groups)."""
        with self._cond:
            return sum(len(g) for g in self._open.values()) + sum(len(g) for g in self._ready)


@dataclass
class BufferSnapshot:
    """Complete groups in training order, then open groups in the order they were opened."""

    ready: list[list[int]] = field(default_factory=list)
    open: list[list[int]] = field(default_factory=list)

    def lsns(self) -> list[int]:
        return [n for group in (*self.ready, *self.open) for n in group]
