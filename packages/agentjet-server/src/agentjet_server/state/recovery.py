"""Resume and checkpoints, over one ``StateDir``: what ``--resume`` restores and what a checkpoint
records, in one place.

A checkpoint is taken by the learner thread (``TrainingLoop.checkpoint``), which hands its state to
``Recovery.save``: the buffer and the log position are snapshotted together while ingestion is held
still, the log rotates to a new segment, the checkpoint is written (``StateDir.write``), and the
segments it made redundant are compacted. Resume (``Recovery.replay``) is the inverse: counts from
the checkpoint, then the trajectories it had buffered and every one logged after it, in log order.

The live configuration (settings changed through the admin API, and whether learning is paused)
is part of the run: each change is a ``Configured`` record in the log, and each checkpoint carries
the configuration in force, so ``restored_configuration`` finds the newest whichever survived
compaction.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentjet_client.protocol import Trajectory
from agentjet_server.batching.buffer import GroupBuffer
from agentjet_server.errors import StateError
from agentjet_server.ingest.store import TrajectoryStore
from agentjet_server.ingest.wal import TrajectoryLog
from agentjet_server.learner.loop import TrainingLoop
from agentjet_server.state.checkpoint import TRAINING_SETTINGS, CheckpointMeta, StateDir, settings_changes
from agentjet_server.state.mirror import StateMirror

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LiveConfiguration:
    """Settings changed through the admin API (name -> value, as JSON) and the pause switch."""

    changed: dict[str, Any]
    paused: bool = False


def restored_configuration(state: StateDir, log: TrajectoryLog) -> LiveConfiguration:
    """The live configuration a resumed run continues with: the newest admin change in the log,
    else the one the newest checkpoint recorded (the log's older records were compacted)."""
    newest = log.scan.configured
    if newest is not None:
        return LiveConfiguration(dict(newest.live), newest.paused)
    checkpoint = state.resumed
    if checkpoint is not None:
        return LiveConfiguration(dict(checkpoint.meta.live), checkpoint.meta.paused)
    return LiveConfiguration({})


class Recovery:
    def __init__(
        self,
        state: StateDir,
        log: TrajectoryLog,
        store: TrajectoryStore,
        buffer: GroupBuffer,
        model_path: Path,
        keep_checkpoints: int,
        keep_recent: int,
        mirror: StateMirror | None = None,
    ) -> None:
        self.mirror = mirror  # --checkpoint-uri: each checkpoint is uploaded after it is written
        self.state = state
        self.log = log
        self.store = store
        self.buffer = buffer
        self.model_path = model_path
        self.keep_checkpoints = keep_checkpoints
        self.keep_recent = keep_recent
        resumed = state.resumed
        self.last_checkpoint_step: int | None = resumed.meta.step if resumed else None
        self.last_checkpoint_path: Path | None = resumed.path if resumed else None

    def replay(self, loop: TrainingLoop, settings: dict[str, Any]) -> int:
        """Put back what the checkpoint had buffered, then everything acknowledged after it."""
        checkpoint = self.state.resumed
        scan = self.log.scan
        if checkpoint is not None:
            changes = settings_changes(checkpoint.meta.settings, settings)
            if changes:
                logger.warning("resuming with changed training settings: %s", "; ".join(changes))
            self.store.trained = checkpoint.meta.trained
            loop.skipped_batches = checkpoint.meta.skipped_batches
            wanted = checkpoint.meta.buffer.lsns()
            position = checkpoint.meta.next_lsn
        else:
            wanted, position = [], 0
        wanted += sorted(n for n in scan.trajectories if n >= position)
        missing = [n for n in wanted if n not in scan.trajectories]
        if missing:
            raise StateError(
                f"the trajectory log in {self.log.directory} lacks {len(missing)} trajectories the checkpoint "
                f"needs (log sequence numbers {missing[:5]}...); the state dir is damaged"
            )
        for lsn in wanted:
            self.store.replay(Trajectory.model_validate(scan.trajectories[lsn]), lsn)
        self.log.forget()
        version = checkpoint.meta.version if checkpoint else loop.version
        step = checkpoint.meta.step if checkpoint else 0
        logger.info(
            "resumed at step %d, policy v%d: %d trajectories back in the buffer (%d logged after the checkpoint); "
            "%d ids known",
            step,
            version,
            len(wanted),
            len(wanted) - (len(checkpoint.meta.buffer.lsns()) if checkpoint else 0),
            len(scan.seen),
        )
        return len(wanted)

    def save(
        self, trainer_state: dict[str, Any], loop: TrainingLoop, settings: dict[str, Any], live: LiveConfiguration
    ) -> Path:
        """Called by the learner thread with the learner's state: snapshot the buffer and the log
        position together (ingestion held still), write the checkpoint, compact the log."""
        with self.store.locked():
            snapshot = self.buffer.snapshot()
            next_lsn = self.store.next_lsn
            segment = self.log.rotate()
            trained = self.store.trained
        meta = CheckpointMeta(
            step=loop.trainer.steps,
            version=loop.version,
            next_lsn=next_lsn,
            buffer=snapshot,
            trained=trained,
            skipped_batches=loop.skipped_batches,
            segment=segment,
            settings={k: v for k, v in settings.items() if k in TRAINING_SETTINGS},
            live=dict(live.changed),
            paused=live.paused,
            adapter_versions=loop.served.as_dict(),
        )
        started = time.perf_counter()
        path = self.state.write(meta, trainer_state, loop.trainer.model, self.model_path, keep=self.keep_checkpoints)
        self.last_checkpoint_step, self.last_checkpoint_path = meta.step, path
        keep_from = min([next_lsn, *snapshot.lsns()])
        # older segments: no writer touches them
        compacted = self.log.compact(keep_from, before_segment=segment, keep_recent=self.keep_recent)
        if self.mirror is not None:
            self.mirror.checkpoint_written(path, meta, compacted)
        logger.info(
            "checkpoint %s (policy v%d) in %.2fs; %d log segments compacted",
            path.name,
            meta.version,
            time.perf_counter() - started,
            len(compacted),
        )
        return path
