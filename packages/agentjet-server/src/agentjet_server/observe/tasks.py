"""Per task, what the server was sent to train: episodes, their mean reward, the share solved, and the
groups whose rewards were all equal (no gradient in them). ``/v1/status`` (``tasks``) and the dashboard's
task table show it; a task is the ``task`` its client recorded in each trajectory's metadata (the task's
id), a group the trajectories of one group id, complete once the ``group_size`` the client recorded
have arrived."""

from __future__ import annotations

import threading
from collections import OrderedDict

from agentjet_client.protocol import TaskRate, Trajectory

MAX_TASKS = 2000  # tasks kept, the least recently seen forgotten first
MAX_OPEN_GROUPS = 20000
SHOWN = 100  # in /v1/status: the most recently seen


class TaskTable:
    """Per-task counts of accepted training episodes (thread-safe)."""

    def __init__(self) -> None:
        self._tasks: OrderedDict[str, TaskRate] = OrderedDict()
        self._open: OrderedDict[str, list[float | None]] = OrderedDict()  # group id -> rewards (None: failed)
        self._lock = threading.Lock()

    def record(self, trajectory: Trajectory) -> None:
        meta = trajectory.metadata
        task, size = meta.get("task"), meta.get("group_size")
        if trajectory.purpose != "train" or task is None:
            return
        with self._lock:
            rate = self._tasks.pop(str(task), None) or TaskRate(task=str(task))
            self._tasks[str(task)] = rate  # most recently seen last
            complete = trajectory.status == "complete"
            if complete:
                rate.mean_reward = (rate.mean_reward * rate.episodes + trajectory.reward) / (rate.episodes + 1)
                rate.solved = (rate.solved * rate.episodes + (trajectory.reward >= 1.0)) / (rate.episodes + 1)
                rate.episodes += 1
            if isinstance(size, int) and size > 0:
                rewards = self._open.setdefault(trajectory.task_id, [])
                rewards.append(trajectory.reward if complete else None)
                if len(rewards) >= size:
                    del self._open[trajectory.task_id]
                    done = [r for r in rewards if r is not None]
                    rate.groups += 1
                    rate.tied_groups += len(done) == len(rewards) and max(done) - min(done) <= 1e-9
            while len(self._tasks) > MAX_TASKS:
                self._tasks.popitem(last=False)
            while len(self._open) > MAX_OPEN_GROUPS:
                self._open.popitem(last=False)

    def status(self) -> list[TaskRate]:
        """The most recently seen tasks, newest first (copies)."""
        with self._lock:
            return [rate.model_copy() for rate in list(reversed(self._tasks.values()))[:SHOWN]]
