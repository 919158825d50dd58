"""What one learner step records: its figures (``StepRecord``) for the history, ``/metrics`` and the dashboard,
made from the learner's ``StepStats`` and the batch's own figures (``BatchFigures``: rewards per task tag,
agent and reward component, and the version lag of the trained tokens)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from agentjet_client.protocol import Trajectory
from agentjet_server.versions import PolicyVersions

MAX_LABELS = 256  # task tags / agents with their own series; more fold into "other"


@dataclass
class Mean:
    count: int = 0
    total: float = 0.0

    def add(self, value: float) -> None:
        self.count += 1
        self.total += value

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count else None


@dataclass
class StepRecord:
    """One learner step as the history and ``/metrics`` see it."""

    step: int
    policy_version: int
    loss: float
    grad_norm: float
    step_seconds: float
    weight_update_seconds: float
    sequences: int
    trained_tokens: int
    processed_tokens: int
    trajectories: int
    mean_reward: float | None
    approx_kl: float | None = None
    clip_fraction: float | None = None
    entropy: float | None = None
    reward_by_tag: dict[str, float] = field(default_factory=dict)
    reward_by_agent: dict[str, float] = field(default_factory=dict)
    reward_components: dict[str, float] = field(default_factory=dict)  # mean of each, over the batch
    lag_mean: float | None = None
    lag_max: int | None = None
    # the off-policy correction and the regularisers (None where the objective has none)
    is_weight_mean: float | None = None  # mean truncated importance weight pi_prox (or pi) / pi_behaviour
    is_truncated_fraction: float | None = None  # tokens whose weight hit --is-cap
    behaviour_kl: float | None = None  # approx KL(pi_behaviour || pi_prox): how off-policy the batch was
    kl_reference: float | None = None  # k3 KL to the reference model
    value_error: float | None = None  # PPO: the critic's mean squared error to its returns
    value_mean: float | None = None
    stale_dropped: int = 0  # episodes left out for aging past the bound while they waited
    prepare_seconds: float | None = None  # the no-gradient pass (proximal / reference / values)
    engine_sleep_seconds: float | None = None  # --engine-sleep: the engine's time to fall asleep before the step
    adapter: str | None = None  # with an adapter per agent: the adapter this step trained
    # the loss it ran: "rl" (the policy objective), "distill" (the policy objective with a teacher's
    # advantage, --teacher), "sft" (supervised, ``learner.supervised``) or "dpo" (``learner.preference``)
    mode: str = "rl"
    reward_margin: float | None = None  # "dpo": beta * the pairs' mean margin over the reference
    teacher_kl: float | None = None  # "distill": mean log pi_behaviour - log pi_teacher over the trained tokens
    preference_accuracy: float | None = None  # "dpo": the share of pairs whose chosen answer leads
    # the sampler against the trainer, over the trained tokens that have both log-probs (learner.objective's
    # ``mismatch_figures``): k3 KL(mu || pi_old), quantiles of pi_old / mu per token and per sequence (geometric
    # mean), the two log-probs' correlation; and the shares of tokens rollout correction left out
    mismatch_kl: float | None = None
    mismatch_token_p01: float | None = None
    mismatch_token_p50: float | None = None
    mismatch_token_p99: float | None = None
    mismatch_sequence_p01: float | None = None
    mismatch_sequence_p50: float | None = None
    mismatch_sequence_p99: float | None = None
    mismatch_logprob_corr: float | None = None
    token_masked: float | None = None
    sequence_masked: float | None = None


class BatchFigures(NamedTuple):
    """A batch's mean reward per task tag, per agent and per reward component (``reward_components`` of its
    episodes' metadata: a rubric's functions, a judge) over its complete episodes, and how many of the
    tokens it trains lag the version by how many versions."""

    by_tag: dict[str, float]
    by_agent: dict[str, float]
    lag: Counter[int]
    by_component: dict[str, float]


def batch_figures(
    groups: Iterable[Iterable[Trajectory]], trained: Iterable[Trajectory], version: PolicyVersions | int
) -> BatchFigures:
    """The ``BatchFigures`` of a batch (``trained``: the episodes whose every sampled token it trains), its
    lags against ``version`` (each turn against its adapter's, with an adapter per agent)."""
    versions = PolicyVersions(version) if isinstance(version, int) else version
    tags: dict[str, Mean] = {}
    agents: dict[str, Mean] = {}
    components: dict[str, Mean] = {}
    lag: Counter[int] = Counter()
    for group in groups:
        for trajectory in group:
            if trajectory.status != "complete":
                continue
            tags.setdefault(trajectory.task_tag or "", Mean()).add(trajectory.reward)
            for agent, reward in agent_rewards(trajectory).items():
                agents.setdefault(agent, Mean()).add(reward)
            for name, score in _components(trajectory).items():
                if len(components) < MAX_LABELS or name in components:
                    components.setdefault(name, Mean()).add(score)
    for trajectory in trained:
        for turn in trajectory.turns:
            version = versions.of(turn.adapter) if versions.knows(turn.adapter) else versions.current
            if turn.completion_versions:
                lag.update(max(0, version - v) for v in turn.completion_versions)
            else:
                lag[max(0, version - turn.policy_version)] += len(turn.completion_token_ids)

    def means(table: dict[str, Mean]) -> dict[str, float]:
        return {k: m.mean for k, m in table.items() if m.mean is not None}

    return BatchFigures(means(tags), means(agents), lag, means(components))


def _components(trajectory: Trajectory) -> dict[str, float]:
    """The reward components the client recorded (numbers only; anything else in the metadata is ignored)."""
    found = trajectory.metadata.get("reward_components")
    if not isinstance(found, dict):
        return {}
    return {
        str(k): float(v)
        for k, v in found.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }


def agent_rewards(trajectory: Trajectory) -> dict[str, float]:
    """Each agent's reward: its own (``agent_rewards``) or the episode's, for every agent that sampled."""
    own = trajectory.agent_rewards or {}
    return {turn.agent: own.get(turn.agent, trajectory.reward) for turn in trajectory.turns}


# the sampler-trainer mismatch figures of a step (``StepStats.extra``), by their names there
MISMATCH = (
    "mismatch_kl",
    "mismatch_token_p01",
    "mismatch_token_p50",
    "mismatch_token_p99",
    "mismatch_sequence_p01",
    "mismatch_sequence_p50",
    "mismatch_sequence_p99",
    "mismatch_logprob_corr",
    "token_masked",
    "sequence_masked",
)
# the step's figures that the objective reports (``StepStats.extra``): record field -> figure
FROM_EXTRA = {
    "approx_kl": "approx_kl",
    "clip_fraction": "clip_fraction",
    "entropy": "entropy",
    "is_weight_mean": "is_weight_mean",
    "is_truncated_fraction": "is_truncated_fraction",
    "behaviour_kl": "behaviour_kl",
    "kl_reference": "kl_reference",
    "value_error": "value_error",
    "value_mean": "value_mean",
    "reward_margin": "reward_margin",
    "teacher_kl": "teacher_kl",
    "preference_accuracy": "accuracy",
    **{name: name for name in MISMATCH},
}


def step_record(
    stats: Any,
    batch: Any,
    version: int,
    step: int,
    update_seconds: float,
    slept: float | None,
    figures: BatchFigures,
) -> StepRecord:
    """The figures of one learner step (``stats``: the learner's ``StepStats``; ``batch``: the batch it
    trained), for the history, ``/metrics`` and the dashboard."""
    lag = figures.lag
    lagged = sum(lag.values())
    return StepRecord(
        step=step,
        policy_version=version,
        loss=stats.loss,
        grad_norm=stats.grad_norm,
        step_seconds=stats.seconds,
        weight_update_seconds=update_seconds,
        sequences=stats.sequences,
        trained_tokens=stats.trained_tokens,
        processed_tokens=stats.processed_tokens,
        trajectories=batch.trajectories,
        mean_reward=stats.mean_reward,
        reward_by_tag=figures.by_tag,
        reward_by_agent=figures.by_agent,
        reward_components=figures.by_component,
        lag_mean=sum(k * n for k, n in lag.items()) / lagged if lagged else None,
        lag_max=max(lag) if lag else None,
        stale_dropped=batch.stale,
        prepare_seconds=stats.prepare_seconds,
        engine_sleep_seconds=slept,
        **{name: stats.extra.get(key) for name, key in FROM_EXTRA.items()},
    )
