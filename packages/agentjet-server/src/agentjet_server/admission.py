"""Admission on the server's side: how many episodes runners may start (``budget``, published in
``/v1/status`` as ``admission_budget``), how that budget splits over task tags under ``--mix``
(``by_tag``), and the buffer's bound on pushes (``room``: 413 for a batch that can never fit, 429 with
``Retry-After`` while the learner catches up; nothing of a refused push is acknowledged). Reads the live
settings each time, so ``admin config --set`` applies at once.
"""

from __future__ import annotations

from collections.abc import Callable

from agentjet_client.protocol import TagInfo
from agentjet_server.batching.buffer import GroupBuffer
from agentjet_server.errors import PayloadTooLargeError, RateLimitError
from agentjet_server.ingest.store import TrajectoryStore
from agentjet_server.learner.loop import TrainingLoop
from agentjet_server.settings import ServerSettings


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
        target = s.batch_groups * s.group_size * s.admission_batches
        return max(0, target - self.buffer.buffered)

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
            window = s.batch_groups * s.group_size * s.admission_batches
            weights = sum(s.mix.values())
            done = sum(trained[tag] for tag in s.mix)
            for tag, weight in s.mix.items():
                share = weight / weights
                wanted = share * (done + window) - trained[tag] - buffered[tag]
                out[tag].share = share
                out[tag].admission_budget = max(0, min(overall, int(wanted)))
        return out
