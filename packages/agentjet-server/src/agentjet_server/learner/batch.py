"""From groups of trajectories to a batch of trainable sequences.

``build_batch`` takes the groups the buffer hands the learner and

1. measures staleness again, now, against the version the learner is about to update: a group
   that waited for slow siblings may have aged past ``max_staleness`` since it was accepted.
   ``drop`` leaves such an episode out (``Batch.stale``); ``downweight`` keeps it and halves the
   weight of each of its tokens for every version past the bound (``Batch.downweighted``);
2. for GRPO, normalises rewards among each group's complete episodes (``advantages``)
   and skips groups with no signal (all rewards equal); for PPO, keeps every complete episode
   and places its rewards on tokens (a turn's ``reward`` at the turn's last sampled token, the
   episode's at each timeline's last one) for the learner's GAE;
3. merges each episode's turns into timelines (``batching.timeline``), each of which becomes one
   ``Sequence`` whose sampled tokens are trained, each with its behaviour log-prob and version.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal, TypedDict

from agentjet_client.protocol import Trajectory, Turn
from agentjet_server.batching.timeline import Timeline, build_timelines, call_tokens
from agentjet_server.learner.advantages import Estimator, batch_whitened, episode_advantages
from agentjet_server.learner.config import LearnerConfig
from agentjet_server.versions import PolicyVersions

Algorithm = Literal["grpo", "ppo"]
StalePolicy = Literal["drop", "downweight"]
Mode = Literal["rl", "sft", "dpo"]


@dataclass
class Sequence:
    """A token sequence to train: ``tokens[p]`` is trained for each ``p`` in ``positions``
    (predicted from ``tokens[:p]``), with its behaviour log-prob and advantage. Optional, one per
    position: the policy ``versions`` that sampled them (-1: unknown), the ``rewards`` that arrive
    with them (PPO) and the loss ``weights`` (1 unless down-weighted for staleness)."""

    tokens: list[int]
    positions: list[int]
    old_logprobs: list[float]
    advantages: list[float]
    versions: list[int] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)
    group: int = 0  # index of its GRPO group in the batch (PPO normalises advantages per group)
    adapter: str | None = None  # with an adapter per agent: the adapter that sampled it, and that it trains
    # distillation from a teacher behind HTTP (``learner.teacher``): its log-prob of each trained token, filled
    # just before the step (a local teacher scores the packed micro-batches itself)
    teacher_logprobs: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.positions)
        self.versions = self.versions or [-1] * n
        self.rewards = self.rewards or [0.0] * n
        self.weights = self.weights or [1.0] * n
        lengths = {
            len(self.old_logprobs),
            len(self.advantages),
            len(self.versions),
            len(self.rewards),
            len(self.weights),
        }
        if self.teacher_logprobs:
            lengths.add(len(self.teacher_logprobs))
        if lengths != {n}:
            raise ValueError(
                "a sequence needs one log-prob, advantage, version, reward and weight per trained position"
            )

    @classmethod
    def single(cls, tokens: list[int], completion_start: int, old_logprobs: list[float], advantage: float) -> Sequence:
        """One call: prompt ``tokens[:completion_start]`` untrained, the rest trained."""
        positions = list(range(completion_start, len(tokens)))
        return cls(tokens, positions, list(old_logprobs), [advantage] * len(positions))

    @property
    def trained_tokens(self) -> int:
        return len(self.positions)


@dataclass
class Batch:
    sequences: list[Sequence]
    rewards: list[float]
    groups: int
    skipped_groups: int
    trajectories: int

    call_tokens: int = 0  # what training one sample per call would process
    included: list[Trajectory] = field(default_factory=list)  # episodes whose sampled tokens are all trained
    version: int | None = None  # the policy version the step updates (None: not known)
    stale: int = 0  # episodes left out: older than the staleness bound by the time they were trained
    downweighted: int = 0  # tokens trained with less weight for the same reason
    truncated: int = 0  # episodes cut off at a token limit, left out of the step (mask_truncated)
    # which loss trains it: "rl" the policy objective (GRPO/PPO), "sft" the negative log-likelihood of its
    # trained tokens (supervised fine-tuning: ``learner.supervised``), "dpo" the preference loss on its
    # (chosen, rejected) pairs of sequences (``learner.preference``)
    mode: Mode = "rl"
    lr: float | None = None  # this update's learning rate (the learner's own when None)
    beta: float = 0.1  # "dpo": how far from the reference the preference may pull the policy

    @property
    def trained_tokens(self) -> int:
        return sum(s.trained_tokens for s in self.sequences)

    def by_adapter(self, versions: PolicyVersions) -> dict[str | None, Batch]:
        """With an adapter per agent: one batch per adapter that has sequences, each holding that
        adapter's sequences alone, at that adapter's version (the episodes' figures stay with the whole)."""
        parts: dict[str | None, Batch] = {}
        for sequence in self.sequences:
            if sequence.adapter is None:
                raise ValueError("a sequence of this batch names no adapter, and the learner trains one per agent")
            name = sequence.adapter
            if name not in parts:
                parts[name] = Batch([], self.rewards, self.groups, 0, 0, version=versions.of(name))
            parts[name].sequences.append(sequence)
        return parts


class BatchOptions(TypedDict):
    """``build_batch``'s options as the learner's settings give them (``batch_options``)."""

    keep_flat: bool
    algorithm: Algorithm
    estimator: Estimator
    mask_truncated: bool
    overlong: tuple[int, float] | None
    max_staleness: int | None
    stale_policy: StalePolicy


def batch_options(config: LearnerConfig, max_staleness: int | None, stale_policy: StalePolicy) -> BatchOptions:
    """How the learner builds its batches: a group whose rewards are all equal still comes along where a
    teacher or an entropy bonus gives it a signal; PPO's GAE is computed in the step's pass, not here."""
    return BatchOptions(
        keep_flat=config.entropy_coef > 0 or config.distill_coef > 0,
        algorithm=config.algorithm,
        estimator="grpo" if config.advantage == "gae" else config.advantage,
        mask_truncated=config.mask_truncated,
        overlong=(config.overlong_buffer, config.overlong_penalty) if config.overlong_buffer else None,
        max_staleness=max_staleness,
        stale_policy=stale_policy,
    )


def build_batch(
    groups: list[list[Trajectory]],
    keep_flat: bool = False,
    *,
    algorithm: Algorithm = "grpo",
    version: PolicyVersions | int | None = None,
    max_staleness: int | None = None,
    stale_policy: StalePolicy = "drop",
    estimator: Estimator = "grpo",
    mask_truncated: bool = False,
    overlong: tuple[int, float] | None = None,
) -> Batch:
    """Turn groups of trajectories into trainable sequences (see the module docstring).

    GRPO normalises rewards within each group of siblings: the episode's reward for every
    timeline, or, in a multi-agent episode with ``agent_rewards``, each agent's own reward for
    that agent's timelines (normalised among the same agent of the siblings). A group whose
    rewards are all equal has no policy-gradient signal and is counted as skipped; with
    ``keep_flat`` its sequences still come along (advantage 0) so that an entropy bonus can keep
    a prompt that the policy has collapsed on from staying collapsed.

    ``mask_truncated`` (DAPO's overlong filtering): an episode with a turn cut off at its token limit
    (``finish_reason`` "length") counts in its group's baseline and trains no token (``Batch.truncated``).

    ``overlong`` (buffer, penalty): DAPO's overlong reward shaping (``overlong_shaped``) of the rewards the
    advantages are computed from (``Batch.rewards`` keeps the rewards as reported).

    ``estimator``: the group estimator (``learner.advantages``); with ``reinforce_pp`` the group baselines are
    then whitened over the batch's trained tokens.

    ``version``: the versions the step updates (an int: a server without adapters at that version);
    with adapters each turn's staleness is measured against its own adapter's version.
    """
    if algorithm not in ("grpo", "ppo"):
        raise ValueError(f"unknown algorithm {algorithm!r}: grpo or ppo")
    versions = PolicyVersions(version) if isinstance(version, int) else version
    batch = Batch([], [], len(groups), 0, 0, version=None if versions is None else versions.current)
    check = versions is not None and max_staleness is not None
    for group_index, group in enumerate(groups):
        batch.trajectories += len(group)
        complete = [t for t in group if t.status == "complete" and t.turns]
        if check and stale_policy == "drop":
            fresh = [t for t in complete if _lag(t, versions) <= max_staleness]  # type: ignore[arg-type,operator]
            batch.stale += len(complete) - len(fresh)
            complete = fresh
        batch.rewards.extend(t.reward for t in complete)
        if overlong is not None:
            complete = [overlong_shaped(t, *overlong) for t in complete]
        if algorithm == "ppo":
            advantages: list[dict[str, float]] = [{"": 0.0} for _ in complete]
        else:
            if len(complete) < 2:
                batch.skipped_groups += 1
                continue
            advantages = episode_advantages(complete, estimator)
            if all(a == 0.0 for per_agent in advantages for a in per_agent.values()):
                batch.skipped_groups += 1
                if not keep_flat:
                    continue
        for trajectory, per_agent in zip(complete, advantages, strict=True):
            if mask_truncated and any(turn.finish_reason == "length" for turn in trajectory.turns):
                batch.truncated += 1  # in its group's baseline above, and no token of it trained
                continue
            batch.call_tokens += call_tokens(trajectory.turns)
            batch.included.append(trajectory)
            weights = (lambda t: _stale_weights(t, versions, max_staleness)) if check else None
            for sequence in _sequences(trajectory, per_agent, group_index, algorithm, weights):
                batch.downweighted += sum(1 for w in sequence.weights if w < 1.0)
                batch.sequences.append(sequence)
    if estimator == "reinforce_pp" and algorithm == "grpo":  # the group baselines, whitened over the batch
        whitened = batch_whitened([s.advantages for s in batch.sequences])
        for sequence, values in zip(batch.sequences, whitened, strict=True):
            sequence.advantages = values
    return batch


def _sequences(
    trajectory: Trajectory,
    per_agent: dict[str, float],
    group: int,
    algorithm: Algorithm,
    weights: Callable[[Timeline], list[float]] | None,
) -> Iterator[Sequence]:
    """One sequence per timeline of the episode (each agent's merged turns), at its agent's advantage, with
    its tokens' staleness ``weights`` (None: all 1)."""
    for timeline in build_timelines(trajectory.turns):
        advantage = per_agent.get(timeline.agent, per_agent[""])
        yield Sequence(
            tokens=timeline.tokens,
            positions=timeline.trained,
            old_logprobs=timeline.old_logprobs,
            advantages=[advantage] * len(timeline.trained),
            # a processed sample's behaviour is not the policy of any version: never "current",
            # so the decoupled objective computes the proximal log-probs and corrects pi / mu
            versions=[-1 if p else v for v, p in zip(timeline.versions, timeline.processed, strict=True)],
            rewards=_token_rewards(trajectory, timeline) if algorithm == "ppo" else [],
            weights=weights(timeline) if weights is not None else [],
            group=group,
            adapter=timeline.adapter,
        )


def overlong_shaped(trajectory: Trajectory, buffer: int, penalty: float) -> Trajectory:
    """``trajectory`` with DAPO's overlong reward shaping: a turn of ``L`` completion tokens under a limit of
    ``L_max`` (``Turn.max_tokens``) costs ``penalty * (L - (L_max - buffer)) / buffer`` once ``L`` passes
    ``L_max - buffer`` (``penalty`` at the limit); the episode's reward loses its costliest turn's cost, and each
    agent's own reward (``agent_rewards``) its own costliest turn's. Turns without a known limit cost nothing."""

    def cost(turns: list[Turn]) -> float:
        costs = [
            penalty * min(1.0, (len(t.completion_token_ids) - (t.max_tokens - buffer)) / buffer)
            for t in turns
            if t.max_tokens is not None and len(t.completion_token_ids) > t.max_tokens - buffer
        ]
        return max(costs, default=0.0)

    episode = cost(trajectory.turns)
    agents = trajectory.agent_rewards
    if not episode and not agents:
        return trajectory
    update: dict[str, object] = {"reward": trajectory.reward - episode}
    if agents:
        update["agent_rewards"] = {
            name: reward - cost([t for t in trajectory.turns if t.agent == name]) for name, reward in agents.items()
        }
    return trajectory.model_copy(update=update)


def _lag(trajectory: Trajectory, versions: PolicyVersions) -> int:
    lag = versions.lag(trajectory)
    return 0 if lag is None else lag


def _stale_weights(timeline: Timeline, versions: PolicyVersions | None, bound: int | None) -> list[float]:
    """1 for each token within the bound, halved for every version (of its adapter) past it."""
    assert versions is not None and bound is not None
    version = versions.of(timeline.adapter) if versions.knows(timeline.adapter) else versions.current
    return [0.5 ** max(0, version - v - bound) for v in timeline.versions]


def _token_rewards(trajectory: Trajectory, timeline: Timeline) -> list[float]:
    """Rewards per trained token: each turn's own ``reward`` at its last sampled token, and the
    episode's (or this agent's, from ``agent_rewards``) at the timeline's last one."""
    rewards = [0.0] * len(timeline.trained)
    for i, turn_index in enumerate(timeline.turn_of):
        last_of_turn = i + 1 == len(timeline.turn_of) or timeline.turn_of[i + 1] != turn_index
        turn_reward = trajectory.turns[turn_index].reward
        if last_of_turn and turn_reward is not None:
            rewards[i] += turn_reward
    if rewards:
        rewards[-1] += (trajectory.agent_rewards or {}).get(timeline.agent, trajectory.reward)
    return rewards
