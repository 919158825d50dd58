"""Tool-call health: of the answers to requests that list tools, how many open a tool call that the
server's parser cannot read, per agent and policy version.

RL rewarded only for outcomes can erode a model's call format: the calls decay into malformed JSON,
every episode then ends after its first turn, and the reward alone does not say why. The counts
are in ``/v1/status`` (``tool_calls``), ``/metrics`` and the dashboard; when an agent's share at a
policy version rises well above the share it started at, a warning is logged and shown on the
dashboard's events, once per version.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from agentjet_client.protocol import ToolCallInfo

logger = logging.getLogger(__name__)

VERSIONS_KEPT = 8  # per agent, the newest policy versions whose counts are kept
MIN_ANSWERS = 32  # answers at a version before its share is compared
RISE = 0.10  # a warning: the share at least this much above the baseline, and at least twice it
ADVICE = "keep the format with a reward for well-formed calls, a lower --lr or --kl-coef (docs/first-task.md)"


@dataclass
class _Agent:
    answers: int = 0
    malformed: int = 0
    by_version: OrderedDict[int, list[int]] = field(default_factory=OrderedDict)  # version -> [answers, malformed]
    baseline: tuple[int, float] | None = None  # (version, share) of the first version with MIN_ANSWERS answers
    warned: tuple[int, float] = (-1, 0.0)  # (version, share) of the last warning


class ToolCallHealth:
    """Counts answers and malformed calls; ``on_warning`` gets each warning's message too."""

    def __init__(self, on_warning: Callable[[str], None] | None = None) -> None:
        self.on_warning = on_warning
        self._agents: dict[str, _Agent] = {}
        self._lock = threading.Lock()

    def record(self, agent: str, version: int, malformed: bool) -> None:
        """One answer of ``agent`` sampled at ``version`` to a request with tools."""
        with self._lock:
            counts = self._agents.setdefault(agent, _Agent())
            counts.answers += 1
            counts.malformed += malformed
            at = counts.by_version.setdefault(version, [0, 0])
            at[0] += 1
            at[1] += malformed
            while len(counts.by_version) > VERSIONS_KEPT:
                counts.by_version.popitem(last=False)
            message = self._check(agent, counts, version, at) if at[0] >= MIN_ANSWERS else None
        if message is not None:
            logger.warning("%s", message)
            if self.on_warning is not None:
                self.on_warning(message)

    @staticmethod
    def _check(agent: str, counts: _Agent, version: int, at: list[int]) -> str | None:
        share = at[1] / at[0]
        if counts.baseline is None:
            counts.baseline = (version, share)
            return None
        first, base = counts.baseline
        if version in (first, counts.warned[0]) or share < base + RISE or share < 2 * base or share <= counts.warned[1]:
            return None
        counts.warned = (version, share)
        return (
            f"agent {agent}: {share:.0%} of its answers to requests with tools at policy v{version} open a tool call "
            f"the server cannot read ({base:.0%} at v{first}); RL may be eroding the call format: {ADVICE}"
        )

    def status(self) -> dict[str, ToolCallInfo]:
        """Per agent: answers, malformed calls, and both at each of the newest policy versions."""
        with self._lock:
            return {
                agent: ToolCallInfo(
                    answers=c.answers,
                    malformed=c.malformed,
                    by_version={str(v): list(n) for v, n in c.by_version.items()},
                )
                for agent, c in sorted(self._agents.items())
            }
