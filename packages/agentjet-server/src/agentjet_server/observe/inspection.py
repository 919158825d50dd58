"""Look at a stored trajectory token by token: ``agentjet-server inspect ID --state-dir DIR``, and
the dashboard's trajectory browser (``trajectory_view``, ``RecentTrajectories``), which shows the same.

Finds the trajectory in the server's write-ahead log, merges its turns into timelines exactly as
the learner does, and lists every token of every timeline: position, id, text, whether it is
trained (sampled by the policy) or context, the behaviour log-probability recorded when it was
sampled and, with ``recompute``, the log-probability the current weights (the newest checkpoint)
give it. Timelines are separated by a line saying why a new one started.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agentjet_client.protocol import Trajectory, Turn
from agentjet_server.batching.timeline import Timeline, build_timelines
from agentjet_server.errors import StateError
from agentjet_server.ingest.signing import SampleSigner
from agentjet_server.ingest.wal import Accepted, Evaluated, read_records


def find_trajectory(state_dir: Path, trajectory_id: str) -> Trajectory:
    """A trajectory still in the log (or among the newest compacted ones kept in ``recent.wal``)."""
    log_dir = state_dir / "log"
    compacted = False
    for record in read_records(log_dir, compacted=True, recent=True):
        if isinstance(record, Accepted | Evaluated) and record.id == trajectory_id:
            if record.trajectory is not None:
                return Trajectory.model_validate(record.trajectory)
            compacted = True
    if compacted:
        raise StateError(f"trajectory {trajectory_id} was trained and checkpointed; the log keeps only its id now")
    raise StateError(f"no trajectory {trajectory_id} in the log under {log_dir}; check the id and --state-dir")


def latest_ids(state_dir: Path, count: int) -> list[str]:
    """The ids of the newest ``count`` trajectories whose bodies the log still holds."""
    ids = [
        r.id
        for r in read_records(state_dir / "log", recent=True)
        if isinstance(r, Accepted | Evaluated) and r.trajectory is not None
    ]
    return list(dict.fromkeys(reversed(ids)))[:count][::-1]


@dataclass
class TokenRow:
    position: int
    token_id: int
    text: str
    trained: bool
    turn: int | None
    sampled_logprob: float | None
    recomputed_logprob: float | None


def rows(timeline: Timeline, tokenizer: Any, model: Any = None) -> Iterator[TokenRow]:
    trained = {p: i for i, p in enumerate(timeline.trained)}
    recomputed: list[float] | None = None
    if model is not None:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([timeline.tokens])).logits[0].float()
        logp = torch.log_softmax(logits, -1)
        targets = torch.tensor(timeline.tokens[1:])
        recomputed = [float("nan"), *logp[:-1].gather(-1, targets.unsqueeze(-1)).squeeze(-1).tolist()]
    for position, token in enumerate(timeline.tokens):
        i = trained.get(position)
        yield TokenRow(
            position=position,
            token_id=token,
            text=tokenizer.decode([token], skip_special_tokens=False),
            trained=i is not None,
            turn=timeline.turn_of[i] if i is not None else None,
            sampled_logprob=timeline.old_logprobs[i] if i is not None else None,
            recomputed_logprob=recomputed[position] if recomputed is not None else None,
        )


def verdict(signer: SampleSigner | None, turn: Turn) -> str:
    """``verified`` (this server sampled it, unchanged), ``not_matching`` or ``unsigned``; ``unchecked``
    without the server's key."""
    if signer is None:
        return "unchecked"
    checked = signer.verify_turn(turn)
    return "unsigned" if checked is None else "verified" if checked else "not_matching"


def summary(trajectory: Trajectory, received: float | None = None) -> dict[str, Any]:
    """One line of the trajectory browser."""
    versions = sorted({v for t in trajectory.turns for v in (t.completion_versions or [t.policy_version])})
    return {
        "id": trajectory.id,
        "task_id": trajectory.task_id,
        "tag": trajectory.task_tag,
        "purpose": trajectory.purpose,
        "status": trajectory.status,
        "reward": trajectory.reward,
        "turns": len(trajectory.turns),
        "agents": sorted({t.agent for t in trajectory.turns}),
        "versions": versions,
        "client_id": trajectory.client_id,
        "received": received,
    }


def reward_detail(trajectory: Trajectory) -> list[str]:
    """Where the reward came from, as lines for people (``inspect`` and the dashboard show the same): each
    reward component's score (a Rubric's functions, a judge), each agent's reward, what a judge said."""
    lines = []
    components = trajectory.metadata.get("reward_components")
    if isinstance(components, dict) and components:
        lines.append("reward components: " + ", ".join(f"{name} {_figure(v)}" for name, v in components.items()))
    if trajectory.agent_rewards:
        lines.append("reward by agent: " + ", ".join(f"{n} {_figure(v)}" for n, v in trajectory.agent_rewards.items()))
    judge = trajectory.metadata.get("judge")
    if isinstance(judge, dict):
        how = "kept answer" if judge.get("cached") else f"{judge.get('kind', '?')} call"
        said = str(judge.get("explanation") or "")
        lines.append(
            f"judge {judge.get('model', '?')} ({how}, {judge.get('candidates', '?')} candidates): "
            + repr(said[:300] + ("..." if len(said) > 300 else ""))
        )
    return lines


def _figure(value: Any) -> str:
    return f"{value:g}" if isinstance(value, int | float) else str(value)


def trajectory_view(trajectory: Trajectory, tokenizer: Any, signer: SampleSigner | None) -> dict[str, Any]:
    """What ``agentjet-server inspect`` shows, as data for the dashboard: every timeline the learner
    would train, each token with its text, whether it is trained (and by which call), and its
    sampled log-prob; every call with its signature verdict."""
    timelines = build_timelines(trajectory.turns)
    view = summary(trajectory)
    view["agent_rewards"] = trajectory.agent_rewards
    view["error"] = trajectory.error
    view["code_version"] = trajectory.code_version
    view["metadata"] = trajectory.metadata  # the task, each reward component's score, what a judge said
    view["reward_detail"] = reward_detail(trajectory)
    view["calls"] = [
        {
            "agent": t.agent,
            "model": t.model,
            "policy_version": t.policy_version,
            "finish_reason": t.finish_reason,
            "prompt_tokens": len(t.prompt_token_ids),
            "completion_tokens": len(t.completion_token_ids),
            "signature": verdict(signer, t),
        }
        for t in trajectory.turns
    ]
    view["timelines"] = [
        {
            "agent": timeline.agent,
            "calls": timeline.turns,
            "trained": len(timeline.trained),
            # [token id, text, call index or -1 for context, sampled log-prob or None]
            "tokens": [
                [r.token_id, r.text, -1 if r.turn is None else r.turn, r.sampled_logprob]
                for r in rows(timeline, tokenizer)
            ],
        }
        for timeline in timelines
    ]
    return view


class RecentTrajectories:
    """The newest ``capacity`` accepted or evaluated trajectories, for the dashboard's browser
    (filled from the log, ``recent.wal`` included, at start; then as they arrive)."""

    def __init__(self, capacity: int) -> None:
        self._items: OrderedDict[str, tuple[Trajectory, float | None]] = OrderedDict()
        self.capacity = capacity
        self._lock = threading.Lock()

    def load(self, log_dir: Path) -> None:
        if not self.capacity or not log_dir.is_dir():
            return
        bodies: deque[dict[str, Any]] = deque(maxlen=self.capacity)
        for record in read_records(log_dir, recent=True):
            if isinstance(record, Accepted | Evaluated) and record.trajectory is not None:
                bodies.append(record.trajectory)
        for body in bodies:
            self.add(Trajectory.model_validate(body), None)

    def add(self, trajectory: Trajectory, received: float | None) -> None:
        if not self.capacity:
            return
        with self._lock:
            self._items.pop(trajectory.id, None)
            self._items[trajectory.id] = (trajectory, received)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, trajectory_id: str) -> Trajectory | None:
        with self._lock:
            item = self._items.get(trajectory_id)
        return item[0] if item else None

    def newest(self, limit: int) -> list[dict[str, Any]]:
        with self._lock:
            items = list(self._items.values())[-limit:]
        return [summary(t, received) for t, received in reversed(items)]
