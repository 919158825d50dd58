"""The server's moving parts wired together: engine, chat service, ingestion, learner loop.

``SwarmRuntime`` owns what lives for the whole process; routes (``app``) only translate HTTP to
calls on it. Build it with ``SwarmRuntime.create(engine, settings)``.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from agentjet_client.protocol import (
    LearnerInfo,
    ServerStatus,
    Trajectory,
    TrajectoryBatch,
    TrajectoryBatchResult,
)
from agentjet_server.batching.buffer import GroupBuffer
from agentjet_server.checkpoint import TRAINING_SETTINGS, CheckpointMeta, StateDir, settings_changes
from agentjet_server.engine.base import Engine
from agentjet_server.errors import PayloadTooLargeError, RateLimitError, StateError
from agentjet_server.learner import distributed
from agentjet_server.learner.distributed import DistContext
from agentjet_server.learner.loop import TrainingLoop
from agentjet_server.learner.trainer import Learner, LearnerConfig
from agentjet_server.serving import ChatService
from agentjet_server.settings import ServerSettings
from agentjet_server.signing import SampleSigner
from agentjet_server.store import TrajectoryStore
from agentjet_server.wal import TrajectoryLog

logger = logging.getLogger(__name__)


def trainable_copy(model_path: str, device: str) -> torch.nn.Module:
    """A separate fp32 model for the learner, from the same checkpoint the engine loaded."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model = model.to(device)
    model.eval()
    return model  # type: ignore[no-any-return]


def build_learner(
    settings: ServerSettings,
    model_path: str,
    ctx: DistContext | None = None,
    resume_from: dict[str, Any] | None = None,
) -> Learner:
    """The learner every rank builds identically (same seed, same checkpoint). ``resume_from``
    (rank 0's ``Checkpoint.trainer_state()``) loads a checkpoint's weights, optimizer and RNG;
    under torchrun rank 0 tells the other ranks whether it does, and they load their shards."""
    ctx = ctx or DistContext(device=settings.device)
    torch.manual_seed(settings.seed)
    model = trainable_copy(model_path, ctx.device)
    config = LearnerConfig(
        lr=settings.lr,
        clip_low=settings.clip_low,
        clip_high=settings.clip_high,
        max_grad_norm=settings.max_grad_norm,
        entropy_coef=settings.entropy_coef,
    )
    config_pad = getattr(getattr(model, "config", None), "pad_token_id", None)
    learner = Learner(model, config, pad_id=int(config_pad or 0), ctx=ctx)
    resuming = resume_from is not None
    if ctx.enabled:
        resuming = bool(distributed.broadcast(ctx, resuming))
    if resuming:
        learner.load_training_state(resume_from)
    return learner


class SwarmRuntime:
    def __init__(
        self,
        engine: Engine,
        settings: ServerSettings,
        learner: Learner,
        vocab_size: int,
        state: StateDir | None = None,
        model_path: Path | None = None,
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.state = state
        self.model_path = model_path
        # the key outlives restarts (what was sampled before one still verifies, also when the
        # server died before anything was pushed); --fresh discards it with the run
        self.signer = (
            SampleSigner.load(state.root / "sample.key", renew=settings.fresh)
            if state is not None
            else SampleSigner.random()
        )
        self.chat = ChatService(
            engine,
            default_max_tokens=settings.default_max_tokens,
            signer=self.signer,
            max_token_entries=settings.max_request_token_entries,
        )
        self.buffer = GroupBuffer(settings.group_size, settings.batch_groups, group_timeout=settings.group_timeout_s)
        self.log = TrajectoryLog(state.log_dir) if state is not None else None
        self.store = TrajectoryStore(
            vocab_size,
            settings.max_staleness,
            self.buffer.add,
            self.log,
            self.signer,
            require_signed=settings.signatures_required,
            room=self._room,
        )
        resumed = state.resumed if state is not None else None
        self.loop = TrainingLoop(
            learner,
            self.buffer,
            engine,
            version=resumed.meta.version if resumed else engine.version,
            on_trained=self.store.mark_trained,
            on_version=self.store.record_version,
            save=self._save_checkpoint if state is not None else None,
            checkpoint_every=settings.checkpoint_every,
        )
        self.last_checkpoint_step: int | None = resumed.meta.step if resumed else None
        self.replayed = self._replay() if state is not None and state.resuming else 0
        self.started = time.monotonic()

    @classmethod
    def create(
        cls,
        engine: Engine,
        settings: ServerSettings,
        model_path: str,
        ctx: DistContext | None = None,
        state: StateDir | None = None,
    ) -> SwarmRuntime:
        """Open (or take) the state dir, build the learner (from the newest checkpoint when
        resuming), replay the log into the buffer and start training."""
        state = state or StateDir.open(settings.state_dir, resume=settings.resume, fresh=settings.fresh)
        try:
            checkpoint = state.resumed
            trainer_state = checkpoint.trainer_state() if checkpoint is not None else None
            learner = build_learner(settings, model_path, ctx, resume_from=trainer_state)
            if checkpoint is not None and engine.version != checkpoint.meta.version:
                # an engine built from the original model: give it the checkpoint's weights and version
                assert trainer_state is not None
                engine.update_weights(trainer_state["weights"], checkpoint.meta.version)
            model: Any = learner.model
            runtime = cls(engine, settings, learner, int(model.config.vocab_size), state, Path(model_path))
        except BaseException:
            state.close()
            raise
        runtime.loop.start()
        return runtime

    def _replay(self) -> int:
        """Put back what the checkpoint had buffered, then everything acknowledged after it."""
        assert self.state is not None and self.log is not None
        checkpoint = self.state.resumed
        scan = self.log.scan
        if checkpoint is not None:
            changes = settings_changes(checkpoint.meta.settings, self.settings.model_dump(mode="json"))
            if changes:
                logger.warning("resuming with changed training settings: %s", "; ".join(changes))
            self.store.trained = checkpoint.meta.trained
            self.loop.skipped_batches = checkpoint.meta.skipped_batches
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
        version = checkpoint.meta.version if checkpoint else self.loop.version
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

    def _save_checkpoint(self, trainer_state: dict[str, Any]) -> None:
        """Called by the learner thread with the learner's state: snapshot the buffer and the log
        position together (ingestion held still), write the checkpoint, compact the log."""
        assert self.state is not None and self.log is not None and self.model_path is not None
        with self.store.locked():
            snapshot = self.buffer.snapshot()
            next_lsn = self.store.next_lsn
            segment = self.log.rotate()
            trained = self.store.trained
        meta = CheckpointMeta(
            step=self.loop.learner.steps,
            version=self.loop.version,
            next_lsn=next_lsn,
            buffer=snapshot,
            trained=trained,
            skipped_batches=self.loop.skipped_batches,
            segment=segment,
            settings={k: v for k, v in self.settings.model_dump(mode="json").items() if k in TRAINING_SETTINGS},
        )
        started = time.perf_counter()
        path = self.state.write(
            meta, trainer_state, self.loop.learner.model, self.model_path, keep=self.settings.keep_checkpoints
        )
        self.last_checkpoint_step = meta.step
        keep_from = min([next_lsn, *snapshot.lsns()])
        compacted = self.log.compact(keep_from, before_segment=segment)  # older segments: no writer touches them
        logger.info(
            "checkpoint %s (policy v%d) in %.2fs; %d log segments compacted",
            path.name,
            meta.version,
            time.perf_counter() - started,
            compacted,
        )

    @property
    def version(self) -> int:
        return self.loop.version

    def ingest(self, batch: TrajectoryBatch) -> TrajectoryBatchResult:
        results = self.store.admit_batch(batch.trajectories, self.version)
        return TrajectoryBatchResult(results=results, policy_version=self.version)

    @property
    def max_buffered(self) -> int:
        s = self.settings
        return s.max_buffered or 4 * s.batch_groups * s.group_size * s.admission_batches

    def _room(self, count: int, size: int) -> None:
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

    def admission_budget(self) -> int:
        s = self.settings
        target = s.batch_groups * s.group_size * s.admission_batches
        return max(0, target - self.buffer.buffered)

    def status(self) -> ServerStatus:
        last = self.loop.last
        version, step = self.loop.live  # the served weights' version and step, read together
        return ServerStatus(
            model=self.engine.model_name,
            policy_version=version,
            trajectories=self.store.counts(self.buffer.buffered, self.buffer.aged_out),
            learner=LearnerInfo(
                algorithm=self.settings.algorithm,
                step=step,
                batch_groups=self.settings.batch_groups,
                group_size=self.settings.group_size,
                max_staleness=self.settings.max_staleness,
                last_loss=last.loss if last else None,
                last_step_seconds=last.seconds if last else None,
                last_mean_reward=last.mean_reward if last else None,
                skipped_batches=self.loop.skipped_batches,
                last_error=self.loop.error,
                last_checkpoint_step=self.last_checkpoint_step,
            ),
            admission_budget=self.admission_budget(),
            uptime_s=time.monotonic() - self.started,
            context=self.chat.context.model_copy(),
        )

    def close(self, checkpoint: bool = True) -> None:
        """Stop training (saving a last checkpoint unless ``checkpoint`` is False), then serving."""
        self.loop.close(checkpoint=checkpoint)
        self.engine.close()
        if self.log is not None:
            self.log.close()
        if self.state is not None:
            self.state.close()
