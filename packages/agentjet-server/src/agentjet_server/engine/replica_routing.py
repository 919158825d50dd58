"""Which engine replica a request goes to: prefix affinity within a load margin.

Among the replicas whose load (requests in flight) is within a small margin of the least-loaded
one's, a request goes to the one that already saw the longest prefix of its prompt (chained hashes
of ``BLOCK``-token blocks of earlier prompts and their completions, remembered per replica); among
equals to the least loaded, then to the one remembering the fewest blocks. So the calls of one
episode, whose prompts extend each other, land where their KV prefix is cached (vLLM's prefix
cache), and the load margin spreads requests that share a prefix (a GRPO group, a common system
prompt) once one replica has its share. A replica asleep (``--engine-sleep``) gets requests only
when none is awake.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Any

from agentjet_server.engine.remote import EngineProcess

BLOCK = 32  # tokens per prefix block for affinity
REMEMBERED_BLOCKS = 50_000  # per replica, least recently used forgotten first


def prefix_blocks(token_ids: Sequence[int]) -> list[int]:
    """Chained hashes of the prompt's full ``BLOCK``-token blocks: equal hashes, equal prefixes."""
    out: list[int] = []
    chained = 0
    for start in range(0, len(token_ids) - BLOCK + 1, BLOCK):
        chained = hash((chained, tuple(token_ids[start : start + BLOCK])))
        out.append(chained)
    return out


@dataclasses.dataclass
class Replica:
    """One engine replica: its process, its state, what it served, and the prefix blocks it saw."""

    index: int
    device: str
    engine: EngineProcess | None = None
    state: str = "starting"  # starting, ready, restarting, stopped
    in_flight: int = 0
    requests: int = 0
    tokens: int = 0
    restarts: int = 0
    failovers: int = 0  # requests that died with this replica and went on elsewhere
    sleeps: bool = False  # --engine-sleep: it sleeps through every learner step
    asleep: bool = False
    blocks: collections.OrderedDict[int, None] = dataclasses.field(default_factory=collections.OrderedDict)

    def matched(self, blocks: list[int]) -> int:
        """How many of ``blocks`` (a prompt's, from the first) this replica has seen."""
        n = 0
        for block in blocks:
            if block not in self.blocks:
                break
            n += 1
        return n

    def remember(self, blocks: list[int]) -> None:
        """Note ``blocks`` as seen here (its KV cache likely holds them); the oldest are forgotten."""
        for block in blocks:
            self.blocks[block] = None
            self.blocks.move_to_end(block)
        while len(self.blocks) > REMEMBERED_BLOCKS:
            self.blocks.popitem(last=False)

    def info(self) -> dict[str, Any]:
        """The replica's entry in ``/v1/status``."""
        engine = self.engine
        return {
            "index": self.index,
            "device": self.device,
            "state": self.state,
            "pid": engine.pid if engine is not None else None,
            "version": engine.version if engine is not None else None,
            "in_flight": self.in_flight,
            "requests": self.requests,
            "tokens": self.tokens,
            "restarts": self.restarts,
            "failovers": self.failovers,
            "sleeps": self.sleeps,
            "asleep": self.asleep,
        }


def choose(replicas: Sequence[Replica], blocks: list[int], avoid: set[int]) -> Replica | None:
    """The ready replica for a prompt of ``blocks``, not one of ``avoid`` unless no other is ready; it is
    counted in flight and remembers the blocks. None when no replica is ready. The caller holds the
    lock that guards the replicas."""
    ready = [r for r in replicas if r.state == "ready" and r.index not in avoid]
    if not ready:
        ready = [r for r in replicas if r.state == "ready"]
    if not ready:
        return None
    awake = [r for r in ready if not r.asleep]
    ready = awake or ready  # a sleeper holds its requests until the step ends
    least = min(r.in_flight for r in ready)
    margin = max(2, least // 4)  # affinity wins only while the load stays close
    near = [r for r in ready if r.in_flight <= least + margin]
    # the longest cached prefix; among equals the least loaded, then the one caching least
    best = min(near, key=lambda r: (-r.matched(blocks), r.in_flight, len(r.blocks), r.requests))
    best.remember(blocks)
    best.in_flight += 1
    best.requests += 1
    return best
