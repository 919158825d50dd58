"""What ``research auto`` keeps on disk (``OUT/auto.json``: ``AutoState`` with its ``Round`` s) and the
budgets it spends (``Ledger``: what is used of each, read from that state and the rounds' trials)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field


@dataclass(frozen=True)
class Budgets:
    rounds: int = 3
    trials: int | None = None
    cpu_hours: float | None = None
    gpu_hours: float | None = None
    hours: float | None = None
    tokens: int | None = None


class Round(BaseModel):
    number: int
    phase: Literal["planning", "running", "judging", "done", "abandoned"] = "planning"
    messages: list[dict[str, str]] = Field(default_factory=list)  # this round's conversation
    attempts: int = 0  # plans received
    plan: dict[str, Any] | None = None
    problems: list[list[str]] = Field(default_factory=list)  # each plan's failed checks
    checked: dict[str, Any] | None = None  # what the study plans (``research check``)
    study: str | None = None  # its --out, relative to OUT
    budget_stop: str | None = None
    verdicts: list[dict[str, Any]] = Field(default_factory=list)
    decision: str | None = None
    reason: str | None = None
    next: str | None = None

    @property
    def folder(self) -> str:
        return f"rounds/r{self.number:02d}"


class AutoState(BaseModel):
    topic: str
    code_dir: str
    researcher: dict[str, str]
    rounds: list[Round] = Field(default_factory=list)
    usage: dict[str, int] = Field(default_factory=lambda: {"prompt": 0, "completion": 0, "calls": 0})
    active_s: float = 0.0
    finished: str | None = None  # why the loop ended

    def tokens(self) -> int:
        return self.usage["prompt"] + self.usage["completion"]


class Ledger:
    """What the research has used of its budgets: its own running time (``active_s`` across restarts
    plus this stretch), the researcher's tokens, and the core-hours and GPU-hours of its trials."""

    def __init__(self, state: AutoState, budgets: Budgets, out: Path) -> None:
        self.state, self.budgets, self.out = state, budgets, out
        self.started = time.monotonic()

    def checkpoint(self) -> None:
        """Fold this stretch's running time into the state (before it is saved)."""
        self.state.active_s = self.seconds()
        self.started = time.monotonic()

    def spent(self) -> str | None:
        """Which budget (other than rounds and trials) is used up, if one is."""
        b, state = self.budgets, self.state
        if b.tokens is not None and state.tokens() >= b.tokens:
            return f"the token budget ({b.tokens:,}) is used"
        if b.hours is not None and self.seconds() >= b.hours * 3600:
            return f"the wall-time budget ({b.hours:g} h) is used"
        cpu, gpu = self.trial_hours()
        if b.cpu_hours is not None and cpu >= b.cpu_hours:
            return f"the CPU budget ({b.cpu_hours:g} core-hours) is used"
        if b.gpu_hours is not None and gpu >= b.gpu_hours:
            return f"the GPU budget ({b.gpu_hours:g} GPU-hours) is used"
        return None

    def trial_hours(self) -> tuple[float, float]:
        """Core-hours and GPU-hours the rounds' trials ran (a trial on a listed device counts one GPU)."""
        cpu = gpu = 0.0
        for round_ in self.state.rounds:
            if round_.study is None or round_.checked is None:
                continue
            for path in (self.out / round_.study / "trials").glob("t*/trial.json"):
                record = json.loads(path.read_text())
                seconds = record.get("active_s", 0.0)
                if record.get("run_started_at"):
                    seconds += time.time() - record["run_started_at"]
                if round_.checked.get("devices"):
                    gpu += seconds / 3600
                else:
                    cpu += seconds * int(round_.checked.get("cores_per_trial", 1)) / 3600
        return cpu, gpu

    def trials_left(self) -> int | None:
        if self.budgets.trials is None:
            return None
        ran = ("running", "judging", "done")  # an abandoned plan's trials never ran
        used = sum(int((r.checked or {}).get("trials", 0)) for r in self.state.rounds if r.phase in ran)
        return max(0, self.budgets.trials - used)

    def budget_text(self) -> str:
        b = self.budgets
        parts = [f"{b.rounds - len(self.state.rounds) + 1} round(s) including this one"]
        if b.trials is not None:
            parts.append(f"{self.trials_left()} trials")
        cpu, gpu = self.trial_hours()
        if b.cpu_hours is not None:
            parts.append(f"{max(0.0, b.cpu_hours - cpu):.2f} CPU core-hours")
        if b.gpu_hours is not None:
            parts.append(f"{max(0.0, b.gpu_hours - gpu):.2f} GPU-hours")
        if b.hours is not None:
            parts.append(f"{max(0.0, b.hours - self.seconds() / 3600):.2f} hours of wall time")
        if b.tokens is not None:
            parts.append(f"{max(0, b.tokens - self.state.tokens()):,} researcher tokens")
        return ", ".join(parts)

    def seconds(self) -> float:
        return self.state.active_s + (time.monotonic() - self.started)
