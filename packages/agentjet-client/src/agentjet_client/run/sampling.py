"""Per-task figures of a run, and dynamic sampling: fewer groups of tasks whose groups carry no gradient.

GRPO learns from the differences between the rewards of a group. A group whose rewards are all equal
(the task always solved, or never) has none: its rollouts cost time and teach nothing. DAPO drops such
groups after rolling them out; ``run --dynamic-sampling`` skips them *before*: a task whose last
``window`` finished groups were all tied is started only with probability ``keep`` (so a task that
becomes learnable again, or a policy that forgets one, is seen again), the others always. Skipped
positions of the task order count as played (``taskorder``), so an epoch stays one pass.

``TaskRates`` keeps, per task id, its finished groups, how many were tied, the mean reward and the share
of episodes solved (reward at least 1). The run's summary prints the tasks skipped and the tied share.
"""

from __future__ import annotations

import random
from collections import Counter, deque
from dataclasses import dataclass, field

TIED = 1e-9  # rewards closer than this are equal


@dataclass
class TaskFigures:
    groups: int = 0
    tied: int = 0
    episodes: int = 0
    reward_sum: float = 0.0
    solved: int = 0
    recent: deque[bool] = field(default_factory=lambda: deque(maxlen=8))  # tied, of the last groups

    @property
    def mean_reward(self) -> float:
        return self.reward_sum / self.episodes if self.episodes else 0.0


class TaskRates:
    """Per task: groups finished and tied, rewards; and which tasks dynamic sampling skips now."""

    def __init__(self, window: int = 2, keep: float = 0.25, seed: int | None = None) -> None:
        if window < 1 or not 0 < keep <= 1:
            raise ValueError("dynamic sampling needs a window of at least 1 group and keep in (0, 1]")
        self.window, self.keep = window, keep
        self.tasks: dict[str, TaskFigures] = {}
        self.skipped: Counter[str] = Counter()
        self._open: dict[str, list[float | None]] = {}  # group id -> rewards so far (None: failed)
        self._rng = random.Random(seed)

    def observe(self, group_id: str, task_id: str, reward: float | None, group_size: int) -> None:
        """A training episode's reward (None: it failed); its group counts once all ``group_size`` are in,
        as tied when every one completed with the same reward."""
        figures = self.tasks.setdefault(task_id, TaskFigures())
        if reward is not None:
            figures.episodes += 1
            figures.reward_sum += reward
            figures.solved += reward >= 1.0
        rewards = self._open.setdefault(group_id, [])
        rewards.append(reward)
        if len(rewards) >= group_size:
            del self._open[group_id]
            done = [r for r in rewards if r is not None]
            tied = len(done) == len(rewards) and max(done) - min(done) <= TIED
            figures.groups += 1
            figures.tied += tied
            figures.recent.append(tied)

    def saturated(self, task_id: str) -> bool:
        """Whether the task's last ``window`` finished groups were all tied."""
        figures = self.tasks.get(task_id)
        if figures is None or len(figures.recent) < self.window:
            return False
        return all(list(figures.recent)[-self.window :])

    def skip(self, task_id: str) -> bool:
        """Dynamic sampling: whether to pass over the task's next group now."""
        if self.saturated(task_id) and self._rng.random() >= self.keep:
            self.skipped[task_id] += 1
            return True
        return False

    @property
    def tied_share(self) -> float:
        groups = sum(f.groups for f in self.tasks.values())
        return sum(f.tied for f in self.tasks.values()) / groups if groups else 0.0
