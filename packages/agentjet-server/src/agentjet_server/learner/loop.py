"""The learner's background loop: wait for a batch of groups, step, publish the new weights.

Serving never waits for this loop: it runs in its own thread with its own copy of the model,
and hands finished weights to the engine, which swaps them in between two decode steps. Under
torchrun this thread on rank 0 also drives the other learner ranks: it broadcasts each batch
(and a heartbeat while idle, and ``stop`` at the end) to ``distributed.worker_loop``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from agentjet_client.protocol import Trajectory
from agentjet_server.batching.buffer import GroupBuffer
from agentjet_server.engine.base import Engine
from agentjet_server.errors import StateError
from agentjet_server.learner import distributed
from agentjet_server.learner.trainer import Learner, StepStats, build_batch

logger = logging.getLogger(__name__)


class TrainingLoop:
    def __init__(
        self,
        learner: Learner,
        buffer: GroupBuffer,
        engine: Engine,
        *,
        version: int = 0,
        on_trained: Callable[[int], None] | None = None,
        on_version: Callable[[int], None] | None = None,
        save: Callable[[dict[str, Any]], None] | None = None,
        checkpoint_every: int = 0,
    ) -> None:
        self.learner = learner
        self.buffer = buffer
        self.engine = engine
        # (policy version, learner step) of the weights the engine serves, replaced as one value so a
        # reader never sees a step whose weights are not live yet (the learner counts a step before
        # its weights are gathered and pushed)
        self.live = (version, learner.steps)
        self.last: StepStats | None = None
        self.skipped_batches = 0
        self.error: str | None = None
        self._on_trained = on_trained or (lambda n: None)
        self._on_version = on_version or (lambda v: None)
        self._save = save
        self.checkpoint_every = checkpoint_every
        self.saved_step = learner.steps
        self._final_checkpoint = True
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="agentjet-learner", daemon=True)

    @property
    def version(self) -> int:
        return self.live[0]

    def start(self) -> None:
        self._thread.start()

    def close(self, checkpoint: bool = True) -> None:
        """Stop after the step in progress, then (with ``checkpoint``) save one last checkpoint."""
        self._final_checkpoint = checkpoint
        self._stop.set()
        self.buffer.wake()
        if self._thread.is_alive():
            self._thread.join(timeout=600)
            if self._thread.is_alive():
                logger.error("the learner did not stop within 10 minutes; giving up on it")

    def checkpoint(self) -> None:
        """Save a checkpoint now (call from the learner thread: under torchrun it is collective)."""
        if self._save is None:
            return
        if self.learner.ctx.enabled:
            distributed.broadcast(self.learner.ctx, distributed.CHECKPOINT)
        state = self.learner.training_state()
        self._save(state)
        self.saved_step = self.learner.steps

    def _run(self) -> None:
        ctx = self.learner.ctx
        last_sent = time.monotonic()
        while not self._stop.is_set():
            groups = self.buffer.take_batch(timeout=0.5)
            if groups is None:
                if ctx.enabled and time.monotonic() - last_sent > distributed.HEARTBEAT_SECONDS:
                    distributed.broadcast(ctx, distributed.IDLE)  # keeps the other ranks' wait short of a timeout
                    last_sent = time.monotonic()
                continue
            last_sent = time.monotonic()
            if not self._log_version(self.version + 1):
                self.buffer.put_back()  # stopping while the state dir refuses: the batch stays buffered
                break
            try:
                self.run_step(groups)
            except Exception as exc:  # a failed step is logged and reported; serving goes on
                logger.exception("learner step failed")
                self.error = f"{type(exc).__name__}: {exc}"
                self.buffer.commit()
                continue
            if self.checkpoint_every and self.learner.steps - self.saved_step >= self.checkpoint_every:
                self._try_checkpoint()
        if self._final_checkpoint and self.learner.steps != self.saved_step:
            self._try_checkpoint()
        if ctx.enabled:
            distributed.broadcast(ctx, distributed.STOP)

    def _log_version(self, version: int) -> bool:
        """Make ``version`` durable before the step that creates it (its tokens must never be
        sampled before the log knows it). While the state dir refuses, wait and retry: a step whose
        version can't be logged would be lost on a restart. False if asked to stop meanwhile."""
        delay, waited = 0.5, False
        while True:
            try:
                self._on_version(version)
            except StateError as exc:
                if not waited:
                    logger.error("learner waits for the state dir before step %d: %s", self.learner.steps + 1, exc)
                self.error = f"waiting for the state dir: {exc}"
                waited = True
                if self.learner.ctx.enabled:
                    distributed.broadcast(self.learner.ctx, distributed.IDLE)  # the other ranks wait too
                if self._stop.wait(delay):
                    return False
                delay = min(delay * 2, 30.0)
                continue
            if waited:
                logger.info("the state dir accepts writes again; the learner goes on")
                self.error = None
            return True

    def _try_checkpoint(self) -> None:
        try:
            self.checkpoint()
        except Exception as exc:  # training goes on; the log still holds everything since the last one
            if not (self.error or "").startswith("checkpoint failed"):
                logger.exception("checkpoint failed (retried after every step until it succeeds)")
            self.error = f"checkpoint failed: {type(exc).__name__}: {exc}"
        else:
            if (self.error or "").startswith("checkpoint failed"):
                logger.info("checkpoint at step %d written: the state dir accepts writes again", self.saved_step)
                self.error = None

    def run_step(self, groups: list[list[Trajectory]]) -> StepStats | None:
        batch = build_batch(groups, keep_flat=self.learner.config.entropy_coef > 0)
        if not batch.sequences:
            self.skipped_batches += 1
            self.buffer.commit()
            self._on_trained(batch.trajectories)  # consumed, though nothing was learned from them
            logger.info("batch of %d groups had no reward signal (equal rewards in every group); skipped", batch.groups)
            return None
        if self.learner.ctx.enabled:
            distributed.broadcast(self.learner.ctx, batch)
        stats = self.learner.step(batch)
        weights = self.learner.full_state_dict()
        new_version = self.version + 1  # logged (``_log_version``) before any token can be sampled with it
        self.engine.update_weights(weights, new_version)
        self.live = (new_version, self.learner.steps)
        self.last = stats
        self.buffer.commit()
        self._on_trained(batch.trajectories)
        logger.info(
            "step %d -> policy v%d  loss %.4f  reward %.3f  seqs %d  trained %d  processed %d (per call: %d)  %.2fs",
            self.learner.steps,
            new_version,
            stats.loss,
            stats.mean_reward,
            stats.sequences,
            stats.trained_tokens,
            stats.processed_tokens,
            batch.call_tokens,
            stats.seconds,
        )
        return stats
