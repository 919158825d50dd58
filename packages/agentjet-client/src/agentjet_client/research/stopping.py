"""Early stopping: the rules that end a trial before its budget, as pure functions over its series.

A trial's series (what ``series.py`` builds from the server's public API, read by ``monitor.py``):

* **training reward points**: the mean reward of each ``window`` training episodes the server
  accepted, with the episode count at the end of the window;
* **evaluation points**: the mean reward of each evaluation round (``--eval-every``), by the
  policy version that played it;
* **learner steps**: the history line of every step (loss, entropy, approx_kl, ...).

The rules, in the order they are checked (the first that holds ends the trial, with its reason):

1. *non-finite*: a step's loss or gradient norm is NaN or infinite.
2. *entropy out of bounds*: the mean entropy of the last three steps is below ``min_entropy``
   (the policy went deterministic) or above ``max_entropy`` (it went to noise). A policy that has
   solved its task is nearly deterministic too: set ``min_entropy`` below what a solved task shows.
3. *KL out of bounds*: the last step's approx KL to the behaviour policy is above ``max_kl``.
4. *reward collapse*: the last ``drop_points`` training reward points are all below
   ``best - max_drop * (best - reward_floor)``, after the best one, and their mean is at least
   ``min_z`` standard errors below the best point. With rewards in [0, 1] and ``max_drop`` 0.5, a
   run that had 0.12 and now has 0.0 three windows in a row has collapsed; so has one that had 0.9
   and now has 0.4. The standard errors use the largest variance rewards in
   [``reward_floor``, ``reward_ceiling``] can have at that mean, so they hold for any reward; set
   the two to your task's range. Both conditions keep the dips of a policy at chance from
   counting: the best of 40 windows of 400 episodes at 0.1 is about 0.135 by luck alone, and three
   windows below half of it happen in about 1 run in 100; with the 4 standard errors, in none of
   500 simulated runs at chance rates of 0.02 to 0.25 (``test_research.py``). Also a collapse:
   every episode of the last ``drop_points`` windows or more scored exactly the floor, where the
   mean before makes that a one-in-10,000 chance (a learning rate that breaks the model in its
   first steps leaves too little of a best window for the test above; the learner then has no
   group with unequal rewards and stops stepping).
5. *plateau* (when ``plateau_points`` > 0): after ``min_episodes``, the last ``plateau_points``
   points of the metric's series (evaluation rounds when there are any, else training reward)
   brought no gain of more than ``plateau_delta`` over the best before them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agentjet_client.research.study import StopSection


@dataclass(frozen=True)
class Point:
    """One point of a trial's reward series."""

    t: float  # seconds since the trial first started (its running time)
    episodes: int  # training episodes the server had accepted by then
    reward: float
    n: int  # episodes averaged
    version: int | None = None  # policy version (evaluation rounds)

    def to_json(self) -> dict[str, Any]:
        return {
            "t": round(self.t, 2),
            "episodes": self.episodes,
            "reward": self.reward,
            "n": self.n,
            "version": self.version,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Point:
        return cls(float(data["t"]), int(data["episodes"]), float(data["reward"]), int(data["n"]), data.get("version"))


def stop_reason(
    rules: StopSection, train: Sequence[Point], evals: Sequence[Point], steps: Sequence[dict[str, Any]]
) -> str | None:
    """Why the trial should end now (a sentence that starts with the rule's name), or None."""
    for step in steps[-3:]:
        for figure in ("loss", "grad_norm"):
            value = step.get(figure)
            if not isinstance(value, int | float) or not math.isfinite(value):  # the history drops NaN figures
                return f"collapse: non-finite {figure.replace('_', ' ')} at learner step {step.get('step')}"
    entropies = [s["entropy"] for s in steps[-3:] if isinstance(s.get("entropy"), int | float)]
    if entropies:
        entropy = sum(entropies) / len(entropies)
        at = steps[-1].get("step")
        if rules.min_entropy is not None and entropy < rules.min_entropy:
            return f"collapse: entropy {entropy:.4f} below min_entropy {rules.min_entropy:g} (last 3 steps, step {at})"
        if rules.max_entropy is not None and entropy > rules.max_entropy:
            return f"collapse: entropy {entropy:.4f} above max_entropy {rules.max_entropy:g} (last 3 steps, step {at})"
    if rules.max_kl is not None and steps:
        kl = steps[-1].get("approx_kl")
        if isinstance(kl, int | float) and kl > rules.max_kl:
            return f"collapse: approx KL {kl:.4f} above max_kl {rules.max_kl:g} at step {steps[-1].get('step')}"
    collapse = reward_collapse(rules, train)
    if collapse:
        return collapse
    return plateau(rules, evals or train)


def reward_collapse(rules: StopSection, train: Sequence[Point]) -> str | None:
    k = rules.drop_points
    if rules.max_drop is None or len(train) <= k:
        return None
    best_at = max(range(len(train)), key=lambda i: train[i].reward)
    best = train[best_at]
    if best.reward <= rules.reward_floor or best_at >= len(train) - k:
        return None
    floored = _at_floor(rules, train)
    if floored:
        return floored
    line = best.reward - rules.max_drop * (best.reward - rules.reward_floor)
    last = train[-k:]
    if any(p.reward >= line for p in last):
        return None
    n = sum(p.n for p in last)
    mean = sum(p.reward * p.n for p in last) / n
    spread = math.sqrt(_variance_bound(rules, best.reward) / best.n + _variance_bound(rules, mean) / n)
    z = (best.reward - mean) / spread if spread > 0 else math.inf
    if z < rules.min_z:  # the best window may be luck and the last ones bad luck: not yet a collapse
        return None
    return (
        f"collapse: training reward fell from {best.reward:.3f} (at {best.episodes} episodes) to {mean:.3f} "
        f"over the last {k} windows of {rules.window} episodes (below {line:.3f}: more than {rules.max_drop:.0%} "
        f"of best - floor lost; {z:.1f} standard errors)"
    )


def _at_floor(rules: StopSection, train: Sequence[Point]) -> str | None:
    """Every episode of the trailing windows (at least ``drop_points`` of them) scored the floor,
    when the windows before them had a mean that makes that a one-in-10,000 chance at most (a
    reward in [floor, ceiling] with mean m is above the floor with probability at least
    (m - floor) / (ceiling - floor)). Such a policy gives the learner nothing to learn from: every
    group's rewards are equal."""
    low, high = rules.reward_floor, rules.reward_ceiling
    tail = 0
    while tail < len(train) and train[-1 - tail].reward - low <= 1e-9 * (high - low):
        tail += 1
    if tail < rules.drop_points or tail == len(train):
        return None
    before, after = train[:-tail], train[-tail:]
    mean = sum(p.reward * p.n for p in before) / sum(p.n for p in before)
    episodes = sum(p.n for p in after)
    if mean <= low or (1 - (mean - low) / (high - low)) ** episodes > 1e-4:
        return None
    return (
        f"collapse: every one of the last {episodes} training episodes scored the floor ({low:g}), after a mean of "
        f"{mean:.3f} before: no group has a reward to learn from"
    )


def _variance_bound(rules: StopSection, mean: float) -> float:
    """The largest variance rewards in [floor, ceiling] with this mean can have (Bhatia-Davis);
    a mean outside the range widens it."""
    low, high = min(rules.reward_floor, mean), max(rules.reward_ceiling, mean)
    return (mean - low) * (high - mean)


def plateau(rules: StopSection, series: Sequence[Point]) -> str | None:
    k = rules.plateau_points
    if k == 0 or len(series) <= k or series[-1].episodes < rules.min_episodes:
        return None
    before = max(p.reward for p in series[:-k])
    recent = max(p.reward for p in series[-k:])
    if recent > before + rules.plateau_delta:
        return None
    what = "evaluation rounds" if series[-1].version is not None else f"windows of {rules.window} episodes"
    return (
        f"plateau: no gain over {rules.plateau_delta:g} in the last {k} {what} "
        f"(best before {before:.3f}, since {recent:.3f}, at {series[-1].episodes} episodes)"
    )


class RewardWindow:
    """Turns a server's cumulative reward sum and count (``/metrics``: they restart at zero when
    the server does) into a point per ``size`` episodes."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.last_sum = 0.0
        self.last_count = 0
        self.sum = 0.0
        self.count = 0

    def add(self, total: float, count: int) -> tuple[float, int] | None:
        """The server's figures now; a (mean, episodes) once ``size`` episodes have gathered."""
        if count < self.last_count:  # the server restarted: its counters began again
            self.last_sum, self.last_count = 0.0, 0
        self.sum += total - self.last_sum
        self.count += count - self.last_count
        self.last_sum, self.last_count = total, count
        if self.count < self.size:
            return None
        out = (self.sum / self.count, self.count)
        self.sum, self.count = 0.0, 0
        return out

    def state(self) -> dict[str, float]:
        return {"last_sum": self.last_sum, "last_count": self.last_count, "sum": self.sum, "count": self.count}

    def restore(self, state: dict[str, Any]) -> None:
        self.last_sum = float(state.get("last_sum", 0.0))
        self.last_count = int(state.get("last_count", 0))
        self.sum = float(state.get("sum", 0.0))
        self.count = int(state.get("count", 0))
