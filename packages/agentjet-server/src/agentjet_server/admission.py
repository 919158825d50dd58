"""Admission on the server's side: how many episodes runners may start (``budget``, published in
``/v1/status`` as ``admission_budget``), how that budget splits over task tags under ``--mix``
(``by_tag``), and the buffer's bound on pushes (``room``: 413 for a batch that can never fit, 429 with
``Retry-After`` while the learner catches up; nothing of a refused push is acknowledged). Reads the live
settings each time, so ``admin config --set`` applies at once.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

from agentjet_client.protocol import TagInfo
from agentjet_server.batching.buffer import GroupBuffer
from agentjet_server.errors import PayloadTooLargeError, RateLimitError
from agentjet_server.ingest.store import TrajectoryStore
from agentjet_server.learner.loop import TrainingLoop
from agentjet_server.settings import ServerSettings

logger = logging.getLogger(__name__)


# the admission window's steps, in batches: up while the learner waits and the lag has room, down when the lag
# reaches the bound, and back toward --admission-batches while the learner does not wait
WINDOW_UP, WINDOW_DOWN, WINDOW_EASE = 0.5, 1.0, 0.25
STARVED = 0.25  # the learner waited for its batch at least this share of its step's time: episodes are short
LAG_QUANTILE = 0.95


def lag_quantile(lag: Counter[int], q: float = LAG_QUANTILE) -> int:
    """The ``q`` quantile of trained tokens' lag (``lag``: tokens by versions behind)."""
    total = sum(lag.values())
    seen = 0
    for versions in sorted(lag):
        seen += lag[versions]
        if seen >= q * total:
            return versions
    return 0


class AdmissionWindow:
    """How many batches' worth of episodes runners are invited to run ahead of the learner.

    ``--admission-batches`` is the least. Episodes that finished wait in the buffer for their group's slowest
    sibling, and they count against the window: under an environment whose latency has a long tail the window
    fills with finished episodes while the learner waits for complete groups. So after each step the window
    grows by half a batch while the learner waited for that batch (``STARVED``) and the trained tokens' lag
    (its 95th percentile) is at least two versions under ``--max-staleness``; it shrinks by a batch when the
    lag reaches the bound or the batch left an episode out as stale (its group waited too long for a slow
    sibling), and eases back toward the least while the learner did not wait. It never exceeds
    the bound in batches (the lag of an episode is about the window's batches ahead of it) nor half of
    what the buffer holds."""

    def __init__(self) -> None:
        self.batches: float | None = None  # None: at --admission-batches

    def current(self, s: ServerSettings, max_buffered: int) -> float:
        least = float(s.admission_batches)
        if self.batches is None:
            return least
        most = max(least, min(float(s.max_staleness), max_buffered / (2 * s.batch_groups * s.group_size)))
        return min(max(self.batches, least), most)

    def after_step(
        self,
        s: ServerSettings,
        max_buffered: int,
        lag: Counter[int],
        waited_s: float,
        step_s: float,
        stale: int = 0,
    ) -> None:
        """(learner thread) Adjust the window to the step just taken (``stale``: the episodes its batch left
        out, aged past the bound while their groups waited)."""
        now, least = self.current(s, max_buffered), float(s.admission_batches)
        high = lag_quantile(lag) if lag else 0
        if stale or high >= s.max_staleness:
            wanted = now - WINDOW_DOWN
        elif waited_s >= STARVED * step_s and high + 2 <= s.max_staleness:
            wanted = now + WINDOW_UP
        elif waited_s < STARVED * step_s / 4:
            wanted = now - WINDOW_EASE
        else:
            return
        self.batches = wanted
        after = self.current(s, max_buffered)
        if after != now:
            # a shrink is news (the lag reached the bound); growing and easing back go on all the time
            logger.log(
                logging.INFO if after < now and wanted == now - WINDOW_DOWN else logging.DEBUG,
                "admission window %.1f -> %.1f batches (the learner waited %.2fs for its batch, stepped in %.2fs; "
                "trained tokens' lag p95 %d, bound %d; %d episodes aged past it)",
                now,
                after,
                waited_s,
                step_s,
                high,
                s.max_staleness,
                stale,
            )
        self.batches = after if after != least else None


class Admission:
    def __init__(
        self,
        settings: Callable[[], ServerSettings],
        buffer: GroupBuffer,
        store: TrajectoryStore,
        loop: TrainingLoop,
    ) -> None:
        self._settings = settings
        self.buffer, self.store, self.loop = buffer, store, loop
        self.window = AdmissionWindow()
        self._stale_seen = loop.stale_at_training  # the learner's count of episodes left out as stale, at the last step

    @property
    def batches(self) -> float:
        """The admission window now, in batches (``AdmissionWindow``)."""
        return self.window.current(self.settings, self.max_buffered)

    def after_step(self, lag: Counter[int], step_s: float) -> None:
        """(learner thread) The window after a step that took ``step_s`` and trained tokens of ``lag``."""
        stale, self._stale_seen = self.loop.stale_at_training - self._stale_seen, self.loop.stale_at_training
        self.window.after_step(self.settings, self.max_buffered, lag, self.loop.wait.last_s, step_s, stale)

    def _target(self) -> int:
        s = self.settings
        return round(s.batch_groups * s.group_size * self.batches)

    @property
    def settings(self) -> ServerSettings:
        return self._settings()

    @property
    def max_buffered(self) -> int:
        """Trajectories the buffer holds before pushes get 429 (``--max-buffered``, else four windows)."""
        s = self.settings
        return s.max_buffered or 4 * s.batch_groups * s.group_size * s.admission_batches

    def room(self, count: int, size: int) -> None:
        """Refuse (429, nothing acknowledged) trajectories the buffer has no room for."""
        s, limit = self.settings, self.max_buffered
        if count > limit or size > s.max_buffer_bytes:
            raise PayloadTooLargeError(
                f"this batch holds {count} trajectories (~{size >> 20} MiB buffered) but the server buffers at "
                f"most {limit} (--max-buffered) and {s.max_buffer_bytes >> 20} MiB (--max-buffer-bytes); "
                "send smaller batches",
                code="batch_exceeds_buffer",
            )
        buffered, held = self.buffer.buffered, self.buffer.bytes
        if buffered + count > limit or held + size > s.max_buffer_bytes:
            last = self.loop.last
            wait = max(1.0, last.seconds if last is not None else 5.0)
            raise RateLimitError(
                f"the training buffer is full ({buffered} trajectories, ~{held >> 20} MiB, waiting for the learner; "
                f"limits {limit} and {s.max_buffer_bytes >> 20} MiB); nothing was acknowledged, push again in "
                f"{wait:.0f}s, and start fewer episodes ahead of training (admission_budget in /v1/status)",
                retry_after=wait,
                code="buffer_full",
            )

    def budget(self) -> int:
        """Episodes runners may start now: one admission window less what waits in the buffer."""
        s = self.settings
        if s.serve_only:  # nothing is trained here: no episode is wanted
            return 0
        return max(0, self._target() - self.buffer.buffered)

    def by_tag(self) -> dict[str, TagInfo]:
        """Per task tag: counts, reward and lag of trained episodes, and under ``--mix`` the tag's
        share and own admission budget. A tag's budget is what brings its episodes (trained, and
        buffered) to its share of everything trained so far plus one admission window: a tag that
        fell behind (slower episodes, a client that joined late) is invited to catch up, one ahead
        is held back, so trained batches follow the mix."""
        s = self.settings
        buffered = self.buffer.buffered_by_tag()
        trained, sums = self.loop.tags.figures()
        accepted = self.store.accepted_by_tag.copy()
        out: dict[str, TagInfo] = {}
        for tag in sorted({*accepted, *buffered, *trained, *s.mix}):
            count, reward, lag = sums.get(tag, (0.0, 0.0, 0.0))
            out[tag] = TagInfo(
                accepted=accepted[tag],
                buffered=buffered[tag],
                trained=trained[tag],
                mean_reward=reward / count if count else None,
                mean_lag=lag / count if count else None,
            )
        if s.mix:
            overall = self.budget()
            window = self._target()
            weights = sum(s.mix.values())
            done = sum(trained[tag] for tag in s.mix)
            for tag, weight in s.mix.items():
                share = weight / weights
                wanted = share * (done + window) - trained[tag] - buffered[tag]
                out[tag].share = share
                out[tag].admission_budget = max(0, min(overall, int(wanted)))
        return out
