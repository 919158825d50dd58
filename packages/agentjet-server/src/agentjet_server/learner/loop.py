"""The learner's background loop: wait for a batch of groups, step, publish the new weights.

Serving never waits for this loop: it runs in its own thread with its own copy of the model,
and hands finished weights to the engine, which swaps them in between two decode steps. Under
torchrun this thread on rank 0 also drives the other learner ranks: it broadcasts each batch
(and a heartbeat while idle, and ``stop`` at the end) to ``worker_loop``, which the other ranks
run instead.

Staleness is measured again when a batch is built (``batching.batch.build_batch``): a group that
waited for slow siblings may have aged past ``max_staleness`` since it was accepted.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from agentjet_client import tracing
from agentjet_client.protocol import Trajectory
from agentjet_server.batching.buffer import GroupBuffer
from agentjet_server.engine.base import Engine
from agentjet_server.errors import StateError
from agentjet_server.learner import distributed
from agentjet_server.learner.batch import Batch, StalePolicy, batch_options, build_batch
from agentjet_server.learner.distributed import DistContext
from agentjet_server.learner.requests import Requests
from agentjet_server.learner.teacher import TeacherUnavailable
from agentjet_server.learner.trainer import Learner, LearnerConfig, StepStats
from agentjet_server.observe.metrics import TagFigures
from agentjet_server.observe.steps import BatchFigures, StepRecord, batch_figures, step_record
from agentjet_server.observe.tracing import step_links
from agentjet_server.versions import PolicyVersions

logger = logging.getLogger(__name__)

TEACHER_RETRY_S = 5.0  # how long a batch waits before asking an unreachable teacher again


class Checkpoints:
    """The learner's checkpoints: every ``every`` steps, when the admin API asks, and at the end. A failed one
    is reported and tried again after every step until one succeeds (the log holds everything since the last)."""

    def __init__(self, learner: Learner | None, save: Callable[[dict[str, Any]], Any] | None, every: int) -> None:
        self.learner = learner
        self._save = save
        self.every = every
        self.saved_step = learner.steps if learner is not None else 0

    def write(self) -> Any:
        """(learner thread: collective under torchrun) A checkpoint now; its path (None: no state dir)."""
        if self._save is None or self.learner is None:
            return None
        if self.learner.ctx.enabled:
            distributed.broadcast(self.learner.ctx, distributed.CHECKPOINT)
        saved = self._save(self.learner.training_state())
        self.saved_step = self.learner.steps
        return saved

    def due(self) -> bool:
        """Whether ``every`` steps went by since the last checkpoint."""
        return bool(self.every and self.learner is not None and self.learner.steps - self.saved_step >= self.every)

    def request(self, requests: Requests) -> Future[Any]:
        """A checkpoint written by the learner thread after the step in progress (or at once when idle)."""
        if self._save is None:
            future: Future[Any] = Future()
            future.set_exception(StateError("this server has no state dir to write checkpoints to"))
            return future
        return requests.checkpoint()

    def answer(self, requests: list[Future[Any]]) -> None:
        """(learner thread) The checkpoint asked for by ``requests``, written now."""
        try:
            saved = self.write()
        except Exception as exc:
            logger.exception("checkpoint asked for through the admin API failed")
            for future in requests:
                future.set_exception(exc)
        else:
            for future in requests:
                future.set_result(saved)

    def try_write(self, error: str | None) -> str | None:
        """(learner thread) A checkpoint, training going on if it fails; the learner's error after it (``error``
        before it: a failure's message replaces it, a success clears an earlier failure's)."""
        failed = (error or "").startswith("checkpoint failed")
        try:
            self.write()
        except Exception as exc:  # training goes on; the log still holds everything since the last one
            if not failed:
                logger.exception("checkpoint failed (retried after every step until it succeeds)")
            return f"checkpoint failed: {type(exc).__name__}: {exc}"
        if failed:
            logger.info("checkpoint at step %d written: the state dir accepts writes again", self.saved_step)
            return None
        return error


class TrainingLoop:
    def __init__(
        self,
        learner: Learner | None,
        buffer: GroupBuffer,
        engine: Engine,
        *,
        version: int = 0,
        adapter_versions: dict[str, int] | None = None,
        on_trained: Callable[[int], None] | None = None,
        on_version: Callable[[PolicyVersions], None] | None = None,
        save: Callable[[dict[str, Any]], Any] | None = None,
        checkpoint_every: int = 0,
        on_step: Callable[[StepRecord, Any], None] | None = None,
        max_staleness: int | None = None,
        stale_policy: StalePolicy = "drop",
    ) -> None:
        self.learner = learner
        self.buffer = buffer
        self.engine = engine
        # (versions, learner step) of the weights served, replaced as one value: a reader never sees a step
        # whose weights are not live yet (the learner counts a step before its weights are pushed)
        names = learner.config.adapters if learner is not None else ()
        self._live = (PolicyVersions.start(version, names, adapter_versions), learner.steps if learner else 0)
        self.last: StepStats | None = None
        self.skipped_batches = 0
        self.error: str | None = None
        # staleness at training time: the bound (live through the admin API), what happens to an episode past
        # it, counts of what it did, and the lag of every trained token
        self.max_staleness = max_staleness
        self.stale_policy: StalePolicy = stale_policy
        self.stale_at_training = 0
        self.downweighted_tokens = 0
        self.trained_lag: Counter[int] = Counter()
        self.wait = WaitClock()  # how long the learner waited for the batch it trained last (admission reads it)
        self.tags = TagFigures()  # per task tag: episodes taken into a step, their rewards and lags
        self._on_trained = on_trained or (lambda n: None)
        self._on_version = on_version or (lambda v: None)
        self.on_step = on_step or (lambda record, lag: None)
        self.checkpoints = Checkpoints(learner, save, checkpoint_every)
        # steered by the admin API, carried out by the learner thread between steps
        self.paused = False
        self.requests = Requests(buffer.wake)
        self._final_checkpoint = True
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="agentjet-learner", daemon=True)

    @property
    def live(self) -> tuple[int, int]:
        """(policy version, learner step) of the weights served, read together."""
        versions, step = self._live
        return versions.current, step

    @live.setter
    def live(self, value: tuple[int, int]) -> None:
        version, step = value
        self._live = (PolicyVersions(version, self._live[0].adapters), step)

    @property
    def served(self) -> PolicyVersions:
        """The versions served: the server's, and with an adapter per agent each adapter's."""
        return self._live[0]

    def publish(self, versions: PolicyVersions, step: int) -> None:
        """New weights are live at ``versions`` after learner step ``step`` (replaced as one value)."""
        self._live = (versions, step)

    @property
    def version(self) -> int:
        return self.live[0]

    @property
    def trainer(self) -> Learner:  # a --serve-only server has none, and never starts this loop
        assert self.learner is not None, "a --serve-only server has no learner"
        return self.learner

    def start(self) -> None:
        if self.learner is not None:  # --serve-only: nothing to train
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

    def checkpoint(self) -> Any:
        """Save a checkpoint now (from the learner thread: collective under torchrun); its path."""
        return self.checkpoints.write()

    @property
    def saved_step(self) -> int:
        return self.checkpoints.saved_step

    def request_checkpoint(self) -> Future[Any]:
        """A checkpoint written by the learner thread after the step in progress (or at once when idle)."""
        return self.checkpoints.request(self.requests)

    def reconfigure(self, config: LearnerConfig) -> None:
        """New learner settings (learning rate, clip, entropy bonus...): they apply from the next step."""
        self.requests.reconfigure(config)

    def _carry_out_requests(self) -> None:
        config, checkpoints, calls = self.requests.take()
        if config is not None and config != self.trainer.config:
            if self.trainer.ctx.enabled:
                distributed.broadcast(self.trainer.ctx, distributed.Reconfigure(config))
            logger.info("learner settings changed: %s", _differences(self.trainer.config, config))
            self.trainer.reconfigure(config)
        if checkpoints:
            self.checkpoints.answer(checkpoints)
        self.requests.run(calls)

    def _run(self) -> None:
        ctx = self.trainer.ctx
        last_sent = time.monotonic()
        while not self._stop.is_set():
            self._carry_out_requests()
            self.wait.begin()
            groups = None if self.paused else self.buffer.take_batch(timeout=0.5)
            if groups is not None and self.paused:  # paused while waiting for the batch: not trained now
                self.buffer.put_back()
                groups = None
            if self.paused:
                self.wait.reset()  # a pause is not a wait for episodes
                self._stop.wait(0.2)
            if groups is None:
                if ctx.enabled and time.monotonic() - last_sent > distributed.HEARTBEAT_SECONDS:
                    distributed.broadcast(ctx, distributed.IDLE)  # keeps the other ranks' wait short of a timeout
                    last_sent = time.monotonic()
                continue
            last_sent = time.monotonic()
            self.wait.end()
            # a change that came while the batch was awaited applies to it: "from the next step" holds
            self._carry_out_requests()
            try:
                with tracing.span(
                    "learner step", links=step_links(groups), attributes={"agentjet.step": self.trainer.steps + 1}
                ):
                    self.run_step(groups)
            except _Stopping:
                self.buffer.put_back()  # stopping while the state dir refuses: the batch stays buffered
                break
            except TeacherUnavailable as exc:  # the batch waits for the teacher: nothing is lost to its outage
                _keep_for_teacher(self, exc)
                continue
            except Exception as exc:  # a failed step is logged and reported; serving goes on
                logger.exception("learner step failed")
                self.error = f"{type(exc).__name__}: {exc}"
                self.buffer.commit()
                continue
            if self.checkpoints.due():
                self.error = self.checkpoints.try_write(self.error)
        _, requests, calls = self.requests.take()
        self.requests.run(calls, stopping=True)
        if requests:  # asked for while stopping: that checkpoint is the last one
            self.checkpoints.answer(requests)
        elif self._final_checkpoint and self.trainer.steps != self.saved_step:
            self.error = self.checkpoints.try_write(self.error)
        if ctx.enabled:
            distributed.broadcast(ctx, distributed.STOP)

    def log_version(self, version: PolicyVersions | int) -> bool:
        """Make ``version`` durable before the step that creates it (its tokens must never be
        sampled before the log knows it). While the state dir refuses, wait and retry: a step whose
        version can't be logged would be lost on a restart. False if asked to stop meanwhile."""
        versions = version if isinstance(version, PolicyVersions) else PolicyVersions(version, self.served.adapters)
        delay, waited = 0.5, False
        while True:
            try:
                self._on_version(versions)
            except StateError as exc:
                if not waited:
                    logger.error("learner waits for the state dir before step %d: %s", self.trainer.steps + 1, exc)
                self.error = f"waiting for the state dir: {exc}"
                waited = True
                if self.trainer.ctx.enabled:
                    distributed.broadcast(self.trainer.ctx, distributed.IDLE)  # the other ranks wait too
                if self._stop.wait(delay):
                    return False
                delay = min(delay * 2, 30.0)
                continue
            if waited:
                logger.info("the state dir accepts writes again; the learner goes on")
                self.error = None
            return True

    def run_step(self, groups: list[list[Trajectory]]) -> StepStats | None:
        """Train one batch: one policy update, or with an adapter per agent one per adapter with turns in
        it (each its own publish, with its own version). The stats of the last update (None: none)."""
        config = self.trainer.config
        served = self.served
        options = batch_options(config, self.max_staleness, self.stale_policy)
        batch = build_batch(groups, version=served, **options)
        # first: a batch kept for an unreachable teacher must count nothing yet
        if _teacher_scores(self.trainer, batch) and (self.error or "").startswith("TeacherUnavailable"):
            self.error = None  # it answers again
        self.stale_at_training += batch.stale
        self.downweighted_tokens += batch.downweighted
        self.tags.count(groups, served)
        if batch.stale:
            logger.info("%d episodes aged past the staleness bound while they waited: not trained", batch.stale)
        if not batch.sequences:
            self.skipped_batches += 1
            self.buffer.commit()
            self._on_trained(batch.trajectories)  # consumed, though nothing was learned from them
            logger.info("batch of %d groups had no reward signal (equal rewards in every group); skipped", batch.groups)
            return None
        parts = batch.by_adapter(served) if config.adapters else {None: batch}
        last = served
        for name in parts:
            last = last.after_step([name] if name is not None else [])
        # durable before any token can be sampled with them: the newest versions say every one before
        if not self.log_version(last):
            raise _Stopping
        figures = batch_figures(groups, batch.included, served)
        self.trained_lag.update(figures.lag)
        batch.included = []  # the other ranks need the sequences only
        stats: StepStats | None = None
        for name, part in parts.items():
            stats = train_part(self, part, name, batch, figures)
        self.buffer.commit()
        self._on_trained(batch.trajectories)
        return stats


class WaitClock:
    """How long the learner waited for a batch: from its first look for one to the batch (pauses left out)."""

    def __init__(self) -> None:
        self.since: float | None = None
        self.last_s = 0.0  # the wait for the batch trained last

    def begin(self) -> None:
        if self.since is None:
            self.since = time.monotonic()

    def reset(self) -> None:
        self.since = None

    def end(self) -> None:
        if self.since is not None:
            self.last_s, self.since = time.monotonic() - self.since, None


def _teacher_scores(learner: Learner, batch: Batch) -> bool:
    """(learner thread) With a teacher behind a URL, its log-probs of the batch's trained tokens; whether it
    was asked."""
    teacher = learner.remote_teacher
    if teacher is None or learner.config.distill_coef <= 0:
        return False
    teacher.score(batch.sequences)
    return True


def _keep_for_teacher(loop: TrainingLoop, exc: TeacherUnavailable) -> None:
    """(learner thread) The teacher cannot be reached: the batch goes back to the buffer, tried again later."""
    logger.warning("%s; the batch is kept and tried again in %.0f s", exc, TEACHER_RETRY_S)
    loop.error = f"TeacherUnavailable: {exc}"
    loop.buffer.put_back()
    loop._stop.wait(TEACHER_RETRY_S)


class _Stopping(Exception):
    """The server stops while the state dir refuses the step's version: the batch is not trained."""


def train_part(loop: TrainingLoop, part: Batch, adapter: str | None, batch: Batch, figures: BatchFigures) -> StepStats:
    """(learner thread) One policy update on ``part`` (of ``adapter``, with an adapter per agent), published
    (``batch``: the whole batch it is part of, and ``figures`` its figures, for the step's record)."""
    new = loop.served.after_step([adapter] if adapter is not None else [])
    stats, update_seconds, slept = update_engine(loop.engine, loop.trainer, part, adapter, new)
    loop.publish(new, loop.trainer.steps)
    loop.last = stats
    record = step_record(stats, batch, new.current, loop.trainer.steps, update_seconds, slept, figures)
    record.adapter = adapter
    record.mode = "distill" if part.mode == "rl" and "teacher_kl" in stats.extra else part.mode
    try:
        loop.on_step(record, figures.lag)
    except Exception:  # figures must never stop training
        logger.exception("recording the step's metrics failed")
    log_step(stats, loop.trainer.steps, new.current, batch.call_tokens, adapter)
    return stats


def update_engine(
    engine: Engine, learner: Learner, part: Batch, adapter: str | None, new: PolicyVersions
) -> tuple[StepStats, float, float | None]:
    """(learner thread) The learner's step on ``part``, its weights pushed to ``engine`` as ``new``, the engine
    asleep through the step with --engine-sleep: the step's figures, the push's seconds and the sleep's."""
    # asleep before the other ranks have the batch: none of them starts its step on a device a
    # sleeping engine replica has not freed yet
    slept = sleep_engine(engine)
    try:
        if learner.ctx.enabled:
            distributed.broadcast(learner.ctx, part)
        stats = learner.step(part, adapter)
        learner.release_gradients()  # between steps that memory serves (or wakes) the engine
        if slept is not None and learner.device.type == "cuda":
            import torch

            torch.cuda.empty_cache()  # the sleeping engine takes its memory back from the driver
        started = time.perf_counter()
        push_weights(engine, learner, new, adapter)  # wakes a sleeping engine
        return stats, time.perf_counter() - started, slept
    except BaseException:
        if slept is not None:  # serve on with the weights it had
            wake_engine(engine)
        raise


def push_weights(engine: Engine, learner: Learner, versions: PolicyVersions, adapter: str | None = None) -> None:
    """The learner's weights to the engine, served as ``versions``: with an adapter per agent, adapter
    ``adapter`` (the one that trained) at its own version; the LoRA adapter alone where the engine serves
    adapters (vLLM); else every weight."""
    if adapter is not None:
        engine.update_named_adapter(adapter, learner.adapter_weights(adapter), versions.of(adapter))
    elif engine.serves_adapters:
        engine.update_adapter(learner.adapter_weights(), versions.current)
    else:
        engine.update_weights(learner.full_state_dict(), versions.current)


def _differences(old: LearnerConfig, new: LearnerConfig) -> str:
    before, after = dataclasses.asdict(old), dataclasses.asdict(new)
    return ", ".join(f"{k} {before[k]} -> {after[k]}" for k in after if before[k] != after[k])


def worker_loop(
    learner: Learner, ctx: DistContext, free_cache: bool = False, replicas: distributed.ReplicaRanks | None = None
) -> None:
    """Ranks other than 0: take part in every step rank 0 starts, until it says stop. ``free_cache``:
    an engine replica sleeps on this rank's GPU through the step; the memory the step cached goes back
    to the driver before rank 0 (waiting for this rank in the weight gather) wakes the replica.
    ``replicas``: with ``--remote-replica-ranks``, a replica rank loads each published version into its
    engine replica."""
    logger.info("learner rank %d waiting for batches", ctx.rank)
    while True:
        message = distributed.broadcast(ctx, None)
        if message == distributed.STOP:
            logger.info("learner rank %d stopping", ctx.rank)
            return
        if message == distributed.IDLE:
            continue
        if isinstance(message, distributed.PublishWeights):
            if replicas is not None and replicas.host is not None:
                load_published(ctx, replicas, message)
            continue
        if message == distributed.CHECKPOINT:
            learner.training_state()  # gathers this rank's shards to rank 0
            continue
        if isinstance(message, distributed.Reconfigure):
            learner.reconfigure(message.config)  # type: ignore[arg-type]
            logger.info("learner rank %d takes new settings (lr %s)", ctx.rank, learner.config.lr)
            continue
        if isinstance(message, distributed.Score):
            learner.score(message.batch, message.adapter)  # type: ignore[arg-type]
            continue
        if not isinstance(message, Batch):
            raise RuntimeError(f"learner rank {ctx.rank} got an unexpected message from rank 0: {message!r}")
        learner.step(message, message.sequences[0].adapter if learner.config.adapters else None)
        learner.release_gradients()
        if free_cache and learner.device.type == "cuda":
            import torch

            torch.cuda.empty_cache()
        learner.full_state_dict()


def load_published(ctx: DistContext, replicas: distributed.ReplicaRanks, message: distributed.PublishWeights) -> None:
    """(a replica rank) The weights rank 0 publishes, into this rank's engine replica, at their version."""
    weights = distributed.receive_weights(ctx, replicas, message)
    ok = True
    try:
        replicas.host.update_weights(weights, message.version)  # type: ignore[attr-defined]
    except Exception:
        logger.exception("rank %d: the engine replica could not load the weights of v%d", ctx.rank, message.version)
        ok = False
    distributed.acknowledge(replicas, ok)


def sleep_engine(engine: Engine) -> float | None:
    """``--engine-sleep``: the engine frees its device memory for the step; the seconds it took, or None
    (no sleep mode, or it failed: the step runs beside the awake engine)."""
    if not engine.can_sleep:
        return None
    started = time.perf_counter()
    try:
        engine.sleep()
    except Exception:
        logger.exception("the engine could not sleep; this step runs beside it")
        wake_engine(engine)
        return None
    return time.perf_counter() - started


def wake_engine(engine: Engine) -> None:
    try:
        engine.wake()
    except Exception:
        logger.exception("the engine could not wake up; it serves again at the next weight update")


def log_step(stats: StepStats, step: int, version: int, call_tokens: int, adapter: str | None = None) -> None:
    logger.info(
        "step %d -> policy v%d%s  loss %.4f  reward %.3f  seqs %d  trained %d  processed %d (per call: %d)  %.2fs",
        step,
        version,
        f" (adapter {adapter})" if adapter is not None else "",
        stats.loss,
        stats.mean_reward,
        stats.sequences,
        stats.trained_tokens,
        stats.processed_tokens,
        call_tokens,
        stats.seconds,
    )
