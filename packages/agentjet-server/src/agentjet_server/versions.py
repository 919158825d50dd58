"""Policy versions: the server's, and with an adapter per agent each adapter's own.

The server's ``policy_version`` counts the learner's publishes (the log's order, ``state.json``,
``/v1/status``). A server with one model tags every sampled token with it. A server with an adapter
per agent (``--adapters planner,executor``) tags a token with its adapter's own count instead: the
planner's steps must not age the executor's turns, which were sampled by weights that did not change.
So every staleness figure is measured per turn, against the count its tokens belong to.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from agentjet_client.protocol import Trajectory, Turn


@dataclass(frozen=True)
class PolicyVersions:
    """The versions served now: ``current`` (the server's), and ``adapters`` (name -> that adapter's count)."""

    current: int
    adapters: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        object.__setattr__(self, "adapters", MappingProxyType(dict(self.adapters)))

    @classmethod
    def start(cls, current: int, names: Iterable[str], counts: Mapping[str, int] | None = None) -> PolicyVersions:
        """Versions of a server starting at ``current`` with adapters ``names`` (at ``counts``, else 0)."""
        return cls(current, {name: (counts or {}).get(name, 0) for name in names})

    def of(self, adapter: str | None) -> int:
        """The version new tokens of ``adapter`` (None: the server's model) are tagged with."""
        if adapter is None:
            return self.current
        try:
            return self.adapters[adapter]
        except KeyError:
            raise ValueError(f"no adapter {adapter!r} here (adapters: {', '.join(self.adapters) or 'none'})") from None

    def knows(self, adapter: str | None) -> bool:
        """Whether a turn of ``adapter`` can have been sampled here: with adapters, every turn names one."""
        return adapter in self.adapters if self.adapters else adapter is None

    def turn_lag(self, turn: Turn) -> int:
        """Versions between the oldest weights that sampled ``turn`` and the weights of its adapter now."""
        return self.of(turn.adapter) - turn.oldest_version

    def lag(self, trajectory: Trajectory) -> int | None:
        """The largest lag of the trajectory's turns (None without turns); without adapters, the server's
        version minus its oldest turn's."""
        lags = [self.turn_lag(turn) for turn in trajectory.turns if self.knows(turn.adapter)]
        return max(lags) if lags else None

    def after_step(self, trained: Iterable[str]) -> PolicyVersions:
        """The versions after one publish in which the adapters ``trained`` changed."""
        counts = dict(self.adapters)
        for name in trained:
            counts[name] += 1
        return PolicyVersions(self.current + 1, counts)

    def as_dict(self) -> dict[str, int]:
        return dict(self.adapters)
