"""Changing a trial's settings while it trains: what a study file asks for, and the pure decisions.

Two kinds of change, both carried out by ``live.LiveTuner`` through each trial server's admin API:

* **population-based training** (``[pbt]``): every trial of the study trains at once. Each time a
  trial has trained ``every_episodes`` more episodes it is *ready*; a ready trial among the worst
  ``quantile`` of the running trials (by its score: the mean of its last ``points`` training reward
  windows since its last exploit) *exploits* one of the best ``quantile`` that leads it by ``min_z``
  standard errors, drawn at random: it takes
  that trial's newest checkpoint (weights and optimizer state, ``POST /v1/admin/adopt``), then
  *explores*: each of ``keys`` (searched ``server.*`` settings the server takes live) becomes the
  better trial's value times one of ``perturb``, or with probability ``resample`` a fresh draw from
  its ``[space]`` domain (``PATCH /v1/admin/config``);
* **rules** (``[[adjust]]``): when a figure of the learner's steps (``loss``, ``grad_norm``,
  ``approx_kl``, ``entropy``, ``clip_fraction``, ...), averaged over the last ``over`` steps, crosses
  a bound, live settings change: ``lr = "x0.5"`` multiplies, ``lr = 0.0001`` sets. A rule fires at
  most ``max_times`` per trial, reads only steps after its last firing, and waits ``cooldown_steps``.

::

    [pbt]
    every_episodes = 2000
    quantile = 0.25
    perturb = [0.8, 1.25]

    [[adjust]]
    when = "approx_kl > 0.05"
    over = 3
    set = { lr = "x0.5" }
"""

from __future__ import annotations

import math
import operator
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

_WHEN = re.compile(r"^\s*([a-z_][a-z0-9_]*)\s*(>=|<=|>|<)\s*([-+0-9.eE]+)\s*$")
_OPERATORS: dict[str, Callable[[float, float], bool]] = {
    ">": operator.gt,
    ">=": operator.ge,
    "<": operator.lt,
    "<=": operator.le,
}
_SCALE = re.compile(r"^x\s*([0-9.eE+-]+)$")


class PbtSection(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    every_episodes: int = Field(ge=1, description="a trial is ready each time it trained this many more episodes")
    burn_in_episodes: int = Field(
        default=0, ge=0, description="no trial is ready before it trained this many (an early leader may stall)"
    )
    quantile: float = Field(default=0.25, gt=0, le=0.5, description="the worst share exploits the best share")
    perturb: list[float] = Field(default_factory=lambda: [0.8, 1.25], min_length=1)
    resample: float = Field(default=0.25, ge=0, le=1, description="chance of a fresh draw from [space] instead")
    points: int = Field(default=2, ge=1, description="training reward windows a trial's score averages")
    min_z: float = Field(default=2.0, ge=0, description="a better trial must lead by this many standard errors")
    keys: list[str] | None = Field(default=None, description="settings explore changes: server.* keys of [space]")

    @field_validator("perturb")
    @classmethod
    def _positive(cls, value: list[float]) -> list[float]:
        if any(not math.isfinite(f) or f <= 0 for f in value):
            raise ValueError("perturb factors multiply a setting: give positive numbers, e.g. [0.8, 1.25]")
        return value


class AdjustRule(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    when: str = Field(description='"FIGURE > BOUND" (or >=, <, <=) over a learner step\'s figures')
    over: int = Field(default=3, ge=1, le=16, description="learner steps the figure is averaged over")
    set: dict[str, float | str] = Field(min_length=1, description='live settings: "x0.5" multiplies, a number sets')
    cooldown_steps: int = Field(default=10, ge=0)
    max_times: int = Field(default=3, ge=1)

    @field_validator("when")
    @classmethod
    def _condition(cls, value: str) -> str:
        match = _WHEN.match(value)
        if match is None:
            raise ValueError(f'when = {value!r}: write FIGURE > BOUND, e.g. "approx_kl > 0.05" or "entropy < 0.1"')
        try:
            float(match.group(3))
        except ValueError:
            raise ValueError(f"when = {value!r}: {match.group(3)!r} is not a number") from None
        return value

    @field_validator("set")
    @classmethod
    def _actions(cls, value: dict[str, float | str]) -> dict[str, float | str]:
        for name, action in value.items():
            if isinstance(action, str) and _SCALE.match(action.strip()) is None:
                raise ValueError(f'set {name} = {action!r}: give a number to set, or "x0.5" to multiply')
        return value

    def condition(self) -> tuple[str, str, float]:
        match = _WHEN.match(self.when)
        assert match is not None
        return match.group(1), match.group(2), float(match.group(3))

    def fires(self, steps: Sequence[dict[str, Any]]) -> tuple[float, int] | None:
        """The figure's mean over the last ``over`` of ``steps`` and the last step's number, when it
        crosses the bound (None otherwise, or with fewer steps, or a figure missing from one)."""
        figure, op, bound = self.condition()
        recent = steps[-self.over :]
        values = [s.get(figure) for s in recent]
        if len(recent) < self.over or not all(isinstance(v, int | float) and math.isfinite(v) for v in values):
            return None
        mean = sum(float(v) for v in values if v is not None) / len(values)
        return (mean, int(recent[-1].get("step", 0))) if _OPERATORS[op](mean, bound) else None

    def new_values(self, current: dict[str, Any]) -> dict[str, float]:
        """The settings this rule sets, from the server's ``current`` configuration."""
        out = {}
        for name, action in self.set.items():
            if isinstance(action, str):
                match = _SCALE.match(action.strip())
                assert match is not None
                out[name] = _round(float(current[name]) * float(match.group(1)))
            else:
                out[name] = float(action)
        return out


@dataclass(frozen=True)
class Candidate:
    """A running trial as population-based training ranks it: its score, the episodes it averages,
    and the largest variance an episode's reward can have at that mean."""

    id: str
    score: float
    n: int = 1
    variance: float = 0.0


def exploit_choice(
    ready: str, population: Sequence[Candidate], quantile: float, rng: random.Random, min_z: float = 0.0
) -> str | None:
    """The trial ``ready`` takes its checkpoint from: one of the best ``quantile`` drawn at random,
    when ``ready`` is among the worst ``quantile`` and that trial leads it by ``min_z`` standard
    errors at least (early on every trial is at chance: copying one that is ahead by luck only
    shuffles the population); else None."""
    if len(population) < 2:
        return None
    ranked = sorted(population, key=lambda c: (-c.score, c.id))
    share = max(1, math.ceil(len(ranked) * quantile))
    bottom = {c.id for c in ranked[-share:]}
    if ready not in bottom:
        return None
    own = next(c for c in ranked if c.id == ready)

    def leads(c: Candidate) -> bool:
        spread = math.sqrt(c.variance / max(1, c.n) + own.variance / max(1, own.n))
        return c.score > own.score and (spread == 0 or (c.score - own.score) / spread >= min_z)

    top = [c for c in ranked[:share] if c.id != ready and leads(c)]
    return rng.choice(top).id if top else None


def explore(
    values: dict[str, Any],
    perturb: Sequence[float],
    resample: float,
    draw: Callable[[str], Any],
    rng: random.Random,
) -> dict[str, Any]:
    """New values for ``values`` (the better trial's, by setting name): each multiplied by a factor
    of ``perturb`` (integers stay integers, at least 1), or with probability ``resample``
    ``draw(name)`` (a fresh draw from the setting's ``[space]`` domain)."""
    out: dict[str, Any] = {}
    for name, value in values.items():
        if rng.random() < resample:
            out[name] = draw(name)
        elif isinstance(value, bool) or not isinstance(value, int | float):
            out[name] = value  # a choice among strings: only a fresh draw changes it
        elif isinstance(value, int):
            out[name] = max(1, round(value * rng.choice(list(perturb))))
        else:
            out[name] = _round(value * rng.choice(list(perturb)))
    return out


def _round(value: float) -> float:
    return float(f"{value:.4g}")
