"""What a run did: ``RunReport``, the counts and rewards of a run, written only by the run's own parts.

The runner records each finished episode (``record_episode``), judging its calls, the task order its
notes. Delivery and admission keep their own counts (``DeliveryCounts``: the servers' answers;
``AdmissionCounts``: the first version seen, the waits for a server that does not answer); the report
holds both records and reads them.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from agentjet_client.delivery.admission import AdmissionCounts
from agentjet_client.delivery.sender import DeliveryCounts
from agentjet_client.protocol import Trajectory
from agentjet_client.run.sampling import TaskRates


@dataclass
class RunReport:
    rewards: list[float] = field(default_factory=list)
    started: int = 0
    finished: int = 0
    failed: int = 0
    failure_reasons: Counter[str] = field(default_factory=Counter)
    delivered: DeliveryCounts = field(default_factory=DeliveryCounts)  # written by the senders
    admitted: AdmissionCounts = field(default_factory=AdmissionCounts)  # written by admission
    final_version: int | None = None  # the default server's version as the run ended (it may be past the last answer)
    elapsed_s: float = 0.0
    order_errors: int = 0  # failed writes of the task order's notes to the spool (retried)
    code_versions: Counter[str] = field(default_factory=Counter)  # finished episodes per code version
    rewards_by_version: dict[str, list[float]] = field(default_factory=dict)  # complete episodes only
    agent_rewards: dict[str, list[float]] = field(default_factory=dict)  # each agent's, complete episodes only
    tag_rewards: dict[str, list[float]] = field(default_factory=dict)  # each task tag's ('' untagged), complete only
    episodes_by_tag: Counter[str] = field(default_factory=Counter)  # training episodes started per task tag
    turns_by_agent: Counter[str] = field(default_factory=Counter)  # captured calls of training episodes
    reloads: list[str] = field(default_factory=list)  # code versions swapped in during the run
    reload_errors: list[str] = field(default_factory=list)  # edits that did not load (old code kept)
    eval_rewards: dict[int, list[float]] = field(default_factory=dict)  # policy version -> eval rewards
    evaluated: int = 0  # evaluation episodes finished
    rounds: int = 0  # --sync: batches rolled out and trained
    waiting_for_learner_s: float = 0.0  # --sync: time spent waiting for the server's step
    stopped: str | None = None  # why the run stopped before its end (its episodes kept failing)
    notes: list[str] = field(default_factory=list)  # what the run tells its user at the end (a continued order)
    judging: Counter[str] = field(default_factory=Counter)  # calls, unparsed, errors, cached, tokens, milliseconds
    tasks: TaskRates = field(default_factory=TaskRates)  # per task: groups, tied groups, rewards (``sampling``)

    @property
    def accepted(self) -> int:
        """Answers from the servers that accepted an episode (with agents on several, one per server part)."""
        return self.delivered.accepted

    @property
    def duplicate(self) -> int:
        return self.delivered.duplicate

    @property
    def rejected(self) -> int:
        return self.delivered.rejected

    @property
    def reject_reasons(self) -> Counter[str]:
        return self.delivered.reject_reasons

    @property
    def by_server(self) -> dict[str, Counter[str]]:
        """Each server's answers to training episodes."""
        return self.delivered.by_server

    @property
    def resent_leftovers(self) -> int:
        """Answered items a previous run had left in the spool."""
        return self.delivered.resent_leftovers

    @property
    def spool_errors(self) -> int:
        """Failed spool writes, of trajectories and of the task order's notes (both retried)."""
        return self.delivered.spool_errors + self.order_errors

    @property
    def waits_for_server(self) -> int:
        return self.admitted.waits_for_server

    @property
    def first_version(self) -> int | None:
        return self.admitted.first_version

    @property
    def last_version(self) -> int | None:
        """The newest policy version of the default server the run heard of."""
        known = self.delivered.last_version
        if self.final_version is None:
            return known
        return self.final_version if known is None else max(known, self.final_version)

    def mean(self, lo: float, hi: float, agent: str | None = None) -> float:
        """Mean reward over the fraction ``[lo, hi)`` of finished episodes, in finishing order (of
        ``agent``'s own rewards, if given)."""
        rewards = self.rewards if agent is None else self.agent_rewards.get(agent, [])
        n = len(rewards)
        part = rewards[int(n * lo) : max(int(n * lo) + 1, math.ceil(n * hi))]
        return sum(part) / len(part) if part else math.nan

    def recent_mean(self, window: int) -> float:
        part = self.rewards[-window:]
        return sum(part) / len(part) if part else math.nan

    def record_episode(self, trajectory: Trajectory, evaluation: int | None = None, rewarded: bool = True) -> None:
        """Count a finished episode: an evaluation episode (``evaluation``: the policy version its round
        started at) apart from training ones, whose rewards count only when the episode completed (and
        only once it has its reward: a judged one's is recorded by ``record_reward``)."""
        complete = trajectory.status == "complete"
        if evaluation is not None:
            self.evaluated += 1
        else:
            self.finished += 1
            self.code_versions[trajectory.code_version or "-"] += 1
            self.turns_by_agent.update(t.agent for t in trajectory.turns)
        if complete and rewarded:
            self.record_reward(trajectory, evaluation)
        elif not complete and evaluation is None:
            self._observe(trajectory, None)
        if not complete:
            self.failed += 1
            self.failure_reasons[trajectory.error or "unknown"] += 1

    def _observe(self, trajectory: Trajectory, reward: float | None) -> None:
        group = _group_of(trajectory)
        if group is not None:
            self.tasks.observe(trajectory.task_id, group[0], reward, group[1])

    def record_reward(self, trajectory: Trajectory, evaluation: int | None = None) -> None:
        """The reward of a complete episode (its ``reward``, ``agent_rewards`` and ``task_tag``)."""
        reward = trajectory.reward
        if evaluation is not None:
            self.eval_rewards.setdefault(evaluation, []).append(reward)
            return
        self._observe(trajectory, reward)
        self.rewards.append(reward)
        self.tag_rewards.setdefault(trajectory.task_tag or "", []).append(reward)
        self.rewards_by_version.setdefault(trajectory.code_version or "-", []).append(reward)
        for name, value in (trajectory.agent_rewards or {}).items():
            self.agent_rewards.setdefault(name, []).append(value)


def _group_of(trajectory: Trajectory) -> tuple[str, int] | None:
    """The task id and group size a training trajectory's metadata names (None: not a runner's episode)."""
    meta = trajectory.metadata
    task, size = meta.get("task"), meta.get("group_size")
    return (str(task), int(size)) if task is not None and isinstance(size, int) else None


def coerce_reward(value: Any) -> tuple[float, dict[str, float] | None]:
    """An agent returns its episode's reward, or ``{agent name: reward}`` for a multi-agent episode
    (each agent's timelines are then trained with its own reward; the episode's is their mean)."""
    if isinstance(value, dict) and value:
        rewards = {}
        for name, reward in value.items():
            if not isinstance(name, str) or isinstance(reward, bool) or not isinstance(reward, int | float):
                raise TypeError(f"the agent returned {value!r}; per-agent rewards map agent names to numbers")
            if not math.isfinite(reward):
                raise TypeError(f"the reward of agent {name!r} is {reward}; rewards must be finite numbers")
            rewards[name] = float(reward)
        return sum(rewards.values()) / len(rewards), rewards
    if isinstance(value, bool):
        return float(value), None
    if isinstance(value, int | float) and math.isfinite(value):
        return float(value), None
    raise TypeError(
        f"the agent returned {value!r}; an agent must return its reward as a finite number "
        "(or a dict of them by agent name)"
    )
