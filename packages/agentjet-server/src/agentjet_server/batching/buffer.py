"""Groups accepted trajectories by task id until batches of complete GRPO groups are ready.

A group is complete when ``group_size`` trajectories of one task id have arrived (failed or
truncated ones count towards completion, so a crashed sibling never holds a group open; the
learner trains only the complete ones). Further trajectories of the same task id open a new
group. Complete groups are trained first-in, first-out, ``batch_groups`` at a time.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from agentjet_client.protocol import Trajectory


class GroupBuffer:
    def __init__(self, group_size: int, batch_groups: int) -> None:
        if group_size < 1 or batch_groups < 1:
            raise ValueError("group_size and batch_groups must be at least 1")
        self.group_size = group_size
        self.batch_groups = batch_groups
        # each entry is (log sequence number, trajectory); the numbers let a checkpoint name them
        self._open: OrderedDict[str, list[tuple[int, Trajectory]]] = OrderedDict()
        self._ready: deque[list[tuple[int, Trajectory]]] = deque()
        self._taken: list[list[tuple[int, Trajectory]]] = []  # the batch the learner is training on
        self._cond = threading.Condition()

    def add(self, trajectory: Trajectory, lsn: int = -1) -> None:
        with self._cond:
            group = self._open.setdefault(trajectory.task_id, [])
            group.append((lsn, trajectory))
            if len(group) >= self.group_size:
                del self._open[trajectory.task_id]
                self._ready.append(group)
                if len(self._ready) >= self.batch_groups:
                    self._cond.notify_all()

    def take_batch(self, timeout: float | None = None) -> list[list[Trajectory]] | None:
        """Wait up to ``timeout`` seconds for ``batch_groups`` complete groups and take them. They
        stay in snapshots until ``commit`` (trained) or go back to the front with ``put_back``."""
        with self._cond:
            if not self._cond.wait_for(lambda: len(self._ready) >= self.batch_groups, timeout=timeout):
                return None
            if self._taken:
                raise RuntimeError("the batch taken before was neither committed nor put back")
            self._taken = [self._ready.popleft() for _ in range(self.batch_groups)]
            return [[t for _, t in group] for group in self._taken]

    def commit(self) -> None:
        """The batch last taken is trained (or deliberately skipped): forget it."""
        with self._cond:
            self._taken = []

    def put_back(self) -> None:
        """The batch last taken was not trained: it goes back to the front, to be taken next."""
        with self._cond:
            self._ready.extendleft(reversed(self._taken))
            self._taken = []

    def snapshot(self) -> BufferSnapshot:
        """The log sequence numbers of everything buffered, in buffer order (for a checkpoint)."""
        with self._cond:
            return BufferSnapshot(
                ready=[[n for n, _ in group] for group in (*self._taken, *self._ready)],
                open=[[n for n, _ in group] for group in self._open.values()],
            )

    def wake(self) -> None:
        with self._cond:
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
