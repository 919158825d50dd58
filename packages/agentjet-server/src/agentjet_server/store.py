"""Ingestion of trajectories: idempotency, staleness, validation against the model, counts.

``TrajectoryStore.admit`` decides for each pushed trajectory: ``duplicate`` if its id was seen
before (it is not trained again), ``rejected`` with a reason if it is stale or does not fit the
model, else ``accepted`` and handed to the group buffer.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable

from agentjet_client.protocol import Trajectory, TrajectoryCounts, TrajectoryResult


class TrajectoryStore:
    def __init__(self, vocab_size: int, max_staleness: int, sink: Callable[[Trajectory], None]) -> None:
        self.vocab_size = vocab_size
        self.max_staleness = max_staleness
        self._sink = sink
        self._seen: set[str] = set()
        self._lock = threading.Lock()
        self.accepted = 0
        self.duplicate = 0
        self.rejected: Counter[str] = Counter()
        self.trained = 0

    def _problem(self, trajectory: Trajectory, version: int) -> tuple[str, str] | None:
        """``(reason code, message)`` if the trajectory cannot be trained."""
        oldest = trajectory.oldest_version
        if oldest is not None and oldest > version:
            return "future_version", (
                f"a turn claims policy version {oldest} but the server is at {version}; "
                "send versions exactly as the server returned them"
            )
        if oldest is not None and version - oldest > self.max_staleness:
            return "stale", (
                f"stale: its oldest turn was sampled at policy version {oldest}, the server is at "
                f"{version} and max_staleness is {self.max_staleness}; start fewer episodes ahead "
                "of training (see admission_budget in /v1/status)"
            )
        for i, turn in enumerate(trajectory.turns):
            bad = [t for t in (*turn.prompt_token_ids, *turn.completion_token_ids) if t >= self.vocab_size]
            if bad:
                return "invalid_tokens", (
                    f"turn {i} has token id {bad[0]} but the model's vocabulary has {self.vocab_size} "
                    "tokens; trajectories must carry the token ids the server returned"
                )
        return None

    def admit(self, trajectory: Trajectory, version: int) -> TrajectoryResult:
        with self._lock:
            if trajectory.id in self._seen:
                self.duplicate += 1
                return TrajectoryResult(
                    id=trajectory.id, status="duplicate", reason="already received; not trained again"
                )
            problem = self._problem(trajectory, version)
            if problem is not None:
                code, message = problem
                self.rejected[code] += 1
                self._seen.add(trajectory.id)
                return TrajectoryResult(id=trajectory.id, status="rejected", reason=message)
            self._seen.add(trajectory.id)
            self.accepted += 1
        self._sink(trajectory)
        return TrajectoryResult(id=trajectory.id, status="accepted")

    def mark_trained(self, count: int) -> None:
        with self._lock:
            self.trained += count

    def counts(self, buffered: int) -> TrajectoryCounts:
        with self._lock:
            return TrajectoryCounts(
                accepted=self.accepted,
                duplicate=self.duplicate,
                rejected=sum(self.rejected.values()),
                rejected_by_reason=dict(self.rejected),
                buffered=buffered,
                trained=self.trained,
            )
