"""Look at a stored trajectory token by token: ``agentjet-server inspect ID --state-dir DIR``.

Finds the trajectory in the server's write-ahead log, merges its turns into timelines exactly as
the learner does, and lists every token of every timeline: position, id, text, whether it is
trained (sampled by the policy) or context, the behaviour log-probability recorded when it was
sampled and, with ``recompute``, the log-probability the current weights (the newest checkpoint)
give it. Timelines are separated by a line saying why a new one started.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agentjet_client.protocol import Trajectory
from agentjet_server.batching.timeline import Timeline
from agentjet_server.errors import StateError
from agentjet_server.wal import Accepted, Evaluated, read_records


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
