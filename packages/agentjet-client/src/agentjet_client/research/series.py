"""A trial's reward series as the runner follows it: what each poll of its server (``monitor.Observation``)
adds to it.

* **training points**: the mean reward of each ``window`` training episodes the server accepted
  (``stopping.RewardWindow`` reads them from the server's cumulative counters);
* **evaluation points**: one per in-run evaluation round (``--eval-every``), made once a later round
  has begun or training has ended (the episodes of a round arrive over several polls);
* **learner steps**: the last history lines of steps, for the stopping rules;
* **the final point**: the final evaluation's mean reward, the trial's metric.

Each point is appended to the trial's ``series.jsonl`` when it is made; ``Series.load`` rebuilds the
series from that file and the window's state in ``trial.json`` after the runner restarts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from agentjet_client.research.monitor import Observation, eval_episodes
from agentjet_client.research.stopping import Point, RewardWindow
from agentjet_client.research.trial import TrialDir, TrialRecord

STEPS_KEPT = 16  # learner steps held for the stopping rules (they read the last three)


@dataclass
class EvalRound:
    """The episodes of one evaluation round as they arrive."""

    t: float
    episodes: int
    version: int | None = None
    rewards: list[float] = field(default_factory=list)

    def add(self, version: int, reward: float) -> None:
        self.version = version if self.version is None else min(self.version, version)
        self.rewards.append(reward)

    def point(self) -> Point:
        return Point(self.t, self.episodes, sum(self.rewards) / len(self.rewards), len(self.rewards), self.version)


class Series:
    """One trial's points in memory, written through to its ``series.jsonl``."""

    def __init__(self, files: TrialDir, window: RewardWindow) -> None:
        self.files = files
        self.window = window
        self.train: list[Point] = []
        self.evals: list[Point] = []
        self.steps: list[dict[str, Any]] = []
        self.rounds: dict[str, EvalRound] = {}  # evaluation rounds still arriving

    @classmethod
    def load(cls, files: TrialDir, window: int, record: TrialRecord) -> Series:
        """The series as the trial's files hold it (empty for a new trial)."""
        series = cls(files, RewardWindow(window))
        series.window.restore(record.window)
        for point in files.points():
            if point["kind"] in ("train", "eval"):
                (series.train if point["kind"] == "train" else series.evals).append(Point.from_json(point))
        return series

    def observe(self, record: TrialRecord, observation: Observation) -> None:
        """Add one poll of the trial's server: the points it completes, its learner steps, and (in
        ``record``) the episode count, the last training reward and the history cursor."""
        now = time.time()
        record.episodes = max(record.episodes, observation.train_episodes)
        window = self.window.add(observation.train_sum, observation.train_count)
        if window is not None:
            point = Point(record.seconds(now), record.episodes, window[0], window[1])
            self.train.append(point)
            self.files.append_point("train", point.to_json())
            record.last_reward = point.reward
        for line in observation.lines:
            if line.get("kind") == "step":
                self.steps.append(line)
        del self.steps[:-STEPS_KEPT]
        if record.phase == "training":  # the in-run evaluation rounds (--eval-every): a point per round
            for episode in eval_episodes(observation.lines):
                round_ = self.rounds.setdefault(episode.round, EvalRound(record.seconds(now), record.episodes))
                round_.add(episode.version, episode.reward)
            self.flush_rounds(keep_last=True)
        if record.phase != "evaluating":
            record.history_seq = observation.last_seq
        record.window = self.window.state()

    def flush_rounds(self, keep_last: bool) -> None:
        """Evaluation rounds become points once a later round has begun (or training ended)."""
        for key in list(self.rounds)[: -1 if keep_last else None]:
            point = self.rounds.pop(key).point()
            self.evals.append(point)
            self.files.append_point("eval", point.to_json())

    def final(self, record: TrialRecord, lines: list[dict[str, Any]]) -> bool:
        """The final evaluation's point from the history ``lines`` written since it began: its mean
        reward becomes the trial's metric. False while they hold no evaluation episode."""
        episodes = eval_episodes(lines)
        if not episodes:
            return False
        record.metric = sum(e.reward for e in episodes) / len(episodes)
        record.note(f"final evaluation: {record.metric:.3f} over {len(episodes)} episodes")
        version = max(e.version for e in episodes)
        final = Point(record.seconds(), record.episodes, record.metric, len(episodes), version)
        self.files.append_point("final", final.to_json())
        return True


def train_metric(train: list[Point]) -> float | None:
    """Mean training reward over the last 20% of the episodes."""
    if not train:
        return None
    last = train[-1].episodes
    tail = [p for p in train if p.episodes >= 0.8 * last] or train[-1:]
    return sum(p.reward * p.n for p in tail) / sum(p.n for p in tail)
