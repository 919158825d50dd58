"""The server's moving parts wired together: engine, chat service, ingestion, learner loop.

``SwarmRuntime`` owns what lives for the whole process; routes (``app``) only translate HTTP to
calls on it. Build it with ``create_runtime(engine, settings, model_path)``.
"""

from __future__ import annotations

import logging
import math
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agentjet_client.logs import set_static_ids
from agentjet_client.protocol import (
    LearnerInfo,
    ReplicaInfo,
    ServerStatus,
    TrajectoryBatch,
    TrajectoryBatchResult,
)
from agentjet_server.admission import Admission
from agentjet_server.batching.buffer import GroupBuffer
from agentjet_server.control import Controller, learner_config, public_settings
from agentjet_server.engine.base import Engine
from agentjet_server.errors import ConfigError, ConflictError
from agentjet_server.ingest.signing import SampleSigner
from agentjet_server.ingest.store import TrajectoryStore
from agentjet_server.ingest.wal import TrajectoryLog
from agentjet_server.learner import distributed
from agentjet_server.learner.distributed import DistContext
from agentjet_server.learner.loop import TrainingLoop
from agentjet_server.learner.teacher import RemoteTeacher, TeacherError
from agentjet_server.learner.trainer import Learner
from agentjet_server.learner.training import Training
from agentjet_server.observe.inspection import RecentTrajectories
from agentjet_server.observe.metrics import History, Snapshot, Telemetry, Ticker
from agentjet_server.observe.sinks import open_sinks
from agentjet_server.observe.steps import MISMATCH, StepRecord
from agentjet_server.observe.tracing import record_ingest
from agentjet_server.option_groups import TEACHER_KEY_ENV
from agentjet_server.serving import ChatService, PromptBuilder, Sampler, TextService
from agentjet_server.serving.parsing import load_parser
from agentjet_server.settings import ServerSettings
from agentjet_server.state.checkpoint import METRICS_FILE, SAMPLE_KEY, StateDir
from agentjet_server.state.mirror import StateMirror, open_state_dir
from agentjet_server.state.recovery import LiveConfiguration, Recovery, restored_configuration
from agentjet_server.tinker.service import Service
from agentjet_server.tinker.workbench import Workbench

logger = logging.getLogger(__name__)


def trainable_copy(model_path: str, device: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A separate model for the learner (fp32 master weights unless ``--optimizer-dtype bfloat16``),
    from the same checkpoint the engine loaded."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    model = model.to(device)
    model.eval()
    return model  # type: ignore[no-any-return]


def remote_teacher(settings: ServerSettings, model_path: str) -> RemoteTeacher:
    """The --teacher URL, checked before training starts (it answers, and splits text as the student does)."""
    assert settings.teacher is not None
    from agentjet_server.engine.tokens import ChatTokenizer

    teacher = RemoteTeacher(settings.teacher, settings.teacher_model, os.environ.get(TEACHER_KEY_ENV) or None)
    try:
        name = teacher.connect(ChatTokenizer(Path(model_path)).tokenizer.encode)
    except TeacherError as exc:
        raise ConfigError(str(exc)) from exc
    logger.info("distillation teacher: %s at %s", name, teacher.url)
    return teacher


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
    weights = torch.bfloat16 if settings.optimizer_dtype == "bfloat16" else torch.float32
    # offloaded, the weights never need to be on the device whole: FSDP keeps their shards in host memory
    model = trainable_copy(model_path, "cpu" if settings.cpu_offload else ctx.device, weights)
    config = learner_config(settings)
    config_pad = getattr(getattr(model, "config", None), "pad_token_id", None)
    # the KL's frozen reference: the run's initial weights (the model dir, also when resuming) or --reference
    # frozen, it needs no master weights: it is kept in the learner's compute precision
    compute = torch.bfloat16 if settings.learner_dtype == "bfloat16" else torch.float32
    reference = (
        trainable_copy(str(settings.reference or model_path), ctx.device, compute) if settings.kl_coef > 0 else None
    )
    if reference is not None and _vocab(reference) != _vocab(model):
        raise ConfigError(
            f"--reference {settings.reference} has a vocabulary of {_vocab(reference)} tokens and the model "
            f"{_vocab(model)}: the KL needs the same tokenizer; pass a checkpoint of this model"
        )
    local = settings.teacher is not None and not settings.remote_teacher
    teacher = trainable_copy(str(settings.teacher), ctx.device, compute) if local else None
    remote = remote_teacher(settings, model_path) if settings.remote_teacher and ctx.is_main else None
    if teacher is not None and _vocab(teacher) != _vocab(model):
        raise ConfigError(
            f"--teacher {settings.teacher} has a vocabulary of {_vocab(teacher)} tokens and the model "
            f"{_vocab(model)}: distillation compares log-probs token by token, so it needs the same tokenizer"
        )
    learner = Learner(
        model, config, pad_id=int(config_pad or 0), ctx=ctx, reference=reference, teacher=teacher, remote_teacher=remote
    )
    resuming = resume_from is not None
    if ctx.enabled:
        resuming = bool(distributed.broadcast(ctx, resuming))
    if resuming:
        learner.load_training_state(resume_from)
        learner.reconfigure(config)  # this run's settings, not the optimizer state's saved ones
    return learner


def _vocab(model: torch.nn.Module) -> int:
    config: Any = getattr(model, "config", None)
    return int(getattr(config, "vocab_size", 0) or 0)


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


# the learner's part of /v1/status: settings shown as they are, and the loop's own counts
STATUS_SETTINGS = (
    "algorithm",
    "batch_groups",
    "group_size",
    "max_staleness",
    "off_policy",
    "stale_policy",
    "policy_loss",
)
STATUS_COUNTS = ("skipped_batches", "stale_at_training", "downweighted_tokens")


def learner_info(loop: TrainingLoop, settings: ServerSettings, step: int, checkpoint_step: int | None) -> LearnerInfo:
    """The learner's part of ``/v1/status`` (``step``: read with the served version; the last step's figures
    from the learner's ``StepStats``; a step on data, not episodes, has no mean reward)."""
    last = loop.last
    return LearnerInfo(
        step=step,
        last_loss=_finite(last.loss) if last else None,
        last_step_seconds=last.seconds if last else None,
        last_mean_reward=_finite(last.mean_reward) if last else None,
        last_error=loop.error,
        last_checkpoint_step=checkpoint_step,
        trained_token_lag={str(k): n for k, n in sorted(loop.trained_lag.items())},
        last_mismatch={k: v for k, v in last.extra.items() if k in MISMATCH and math.isfinite(v)} if last else {},
        **{name: getattr(settings, name) for name in STATUS_SETTINGS},
        **{name: getattr(loop, name) for name in STATUS_COUNTS},
    )


@dataclass
class Opened:
    """What ``create_runtime`` opened on disk for a runtime (all None for one without a state dir)."""

    signer: SampleSigner  # signs each sample; its key outlives restarts (what was sampled before one still verifies)
    history: History  # the metrics file and its sinks (TensorBoard, W&B)
    parser: Any  # the tool-call and reasoning parsers of the model
    state: StateDir | None = None
    model_path: Path | None = None
    live: LiveConfiguration | None = None  # settings changed through the admin API before a restart
    log: TrajectoryLog | None = None
    mirror: StateMirror | None = None  # --checkpoint-uri: the object store the run is mirrored to


class SwarmRuntime:
    """One server's parts wired together: the engine and the chat and text services over it, the
    trajectory store and write-ahead log, the group buffer, the learner loop, checkpoints and
    telemetry. ``create_runtime`` opens what it needs on disk and builds it; the HTTP API (``api/``) calls
    into it."""

    def __init__(
        self, engine: Engine, settings: ServerSettings, learner: Learner | None, vocab: int, on: Opened
    ) -> None:
        self.engine, self.settings, self.model_path = engine, settings, on.model_path
        self.state, self.log, self.mirror, self.signer = on.state, on.log, on.mirror, on.signer
        # names this run for clients (their spool is keyed by it): the state dir's, else this process's
        self.run_id = on.state.run_id if on.state is not None else uuid.uuid4().hex[:16]
        self.telemetry = Telemetry(on.history)
        self.prompts = PromptBuilder(
            engine,
            parser=on.parser,
            default_max_tokens=settings.default_max_tokens,
            max_token_entries=settings.max_request_token_entries,
            exact_sampling=settings.exact_sampling,
        )
        sampler = Sampler(engine, signer=self.signer, stats=self.telemetry.serving if settings.metrics else None)
        self.chat = ChatService(self.prompts, sampler, self.telemetry.tool_calls)
        self.text = TextService(self.prompts, sampler)
        self.buffer = GroupBuffer(settings.group_size, settings.batch_groups, group_timeout=settings.group_timeout_s)
        self.store = TrajectoryStore(
            vocab,
            settings.max_staleness,
            self.buffer.add,
            self.log,
            self.signer,
            require_signed=settings.signatures_required,
            room=lambda count, size: self.admission.room(count, size),
            absent=self.buffer.add_absent,
        )
        self.recovery = self._recovery(on)
        resumed = on.state.resumed if on.state is not None else None
        self.loop = TrainingLoop(
            learner,
            self.buffer,
            engine,
            version=resumed.meta.version if resumed else engine.version,
            adapter_versions=resumed.meta.adapter_versions if resumed else None,
            on_trained=self.store.mark_trained,
            on_version=self.store.record_version,
            save=self._save_checkpoint if self.recovery is not None else None,
            checkpoint_every=settings.checkpoint_every,
            on_step=self._on_step,
            max_staleness=settings.max_staleness,
            stale_policy=settings.stale_policy,
        )
        self.admission = Admission(lambda: self.settings, self.buffer, self.store, self.loop)
        self.training = Training(self.loop, engine.chat)
        self._tinker: Service | None = None  # the Tinker API's workbench, made at its first call
        self.control = Controller(
            get_settings=lambda: self.settings,
            set_settings=self._set_settings,
            loop=self.loop,
            store=self.store,
            buffer=self.buffer,
            prompts=self.prompts,
            history=self.telemetry.history,
            live=on.live or LiveConfiguration({}),
        )
        self.replayed = 0  # trajectories of the log put back in the buffer on resuming (``create_runtime``)
        self.recent = RecentTrajectories(settings.keep_recent_trajectories)  # the dashboard's browser
        self.started = time.monotonic()
        self._ticker = Ticker(self.telemetry, self.snapshot, settings.metrics_interval_s) if settings.metrics else None

    def _recovery(self, on: Opened) -> Recovery | None:
        """Checkpoints and replay, with a state dir."""
        if on.state is None or self.log is None:
            return None
        settings = self.settings
        return Recovery(
            on.state,
            self.log,
            self.store,
            self.buffer,
            on.model_path or Path(),
            settings.keep_checkpoints,
            settings.keep_recent_trajectories,
            on.mirror,
        )

    def start(self) -> None:
        """Training and the metrics' ticker start (a --serve-only server has no loop to start)."""
        if self._ticker is not None:
            self._ticker.start()
        self.loop.start()

    def _set_settings(self, settings: ServerSettings) -> None:
        self.settings = settings

    def _save_checkpoint(self, trainer_state: dict[str, Any]) -> Path:
        assert self.recovery is not None
        return self.recovery.save(trainer_state, self.loop, self.settings.model_dump(mode="json"), self.control.live)

    def _on_step(self, record: StepRecord, lag: Any) -> None:
        self.admission.after_step(lag, record.step_seconds + record.weight_update_seconds)
        if self.settings.metrics:
            self.telemetry.record_step(record, lag, self.snapshot())

    @property
    def last_checkpoint_step(self) -> int | None:
        return self.recovery.last_checkpoint_step if self.recovery is not None else None

    def snapshot(self) -> Snapshot:
        """The runtime's own counts, for ``/metrics`` and the history."""
        version, step = self.loop.live
        ready, open_groups = self.buffer.groups
        return Snapshot(
            uptime_s=time.monotonic() - self.started,
            policy_version=version,
            step=step,
            paused=self.loop.paused,
            counts=self.store.counts(self.buffer.buffered, self.buffer.aged_out),
            ready_groups=ready,
            open_groups=open_groups,
            admission_budget=self.admission.budget(),
            checkpoint_step=self.last_checkpoint_step,
            learner_error=self.loop.error,
            by_tag=self.admission.by_tag(),
            replicas=self.engine.replica_status(),
            uploaded_step=self.mirror.last_uploaded_step if self.mirror is not None else None,
            remote_log_lag_bytes=self.mirror.lag_bytes if self.mirror is not None else 0,
        )

    def _mirror_status(self) -> dict[str, Any]:
        """The object store's part of the learner's status (--checkpoint-uri)."""
        if self.mirror is None:
            return {}
        mirror = self.mirror
        return {
            "last_uploaded_step": mirror.last_uploaded_step,
            "remote_log_lag_bytes": mirror.lag_bytes,
            "object_store_error": mirror.error,
        }

    @property
    def version(self) -> int:
        return self.loop.version

    def ingest(self, batch: TrajectoryBatch) -> TrajectoryBatchResult:
        if self.settings.serve_only:  # the API refuses the push first; this guards other callers
            raise ConflictError("this server runs with --serve-only and trains nothing")
        started = time.time()
        results = self.store.admit_batch(batch.trajectories, self.loop.served)
        record_ingest(batch.trajectories, results, started)
        now = time.time()
        for trajectory, result in zip(batch.trajectories, results, strict=True):
            if result.status == "accepted":
                self.recent.add(trajectory, now)
        if self.settings.metrics:
            self.telemetry.record_batch(batch.client, batch.trajectories, results)
        return TrajectoryBatchResult(results=results, policy_version=self.version)

    def status(self) -> ServerStatus:
        version, step = self.loop.live  # the served weights' version and step, read together
        return ServerStatus(
            model=self.engine.model_name,
            policy_version=version,
            trajectories=self.store.counts(self.buffer.buffered, self.buffer.aged_out),
            learner=learner_info(self.loop, self.settings, step, self.last_checkpoint_step).model_copy(
                update={**self._mirror_status(), "admission_window": self.admission.batches}
            ),
            admission_budget=self.admission.budget(),
            by_tag=self.admission.by_tag(),
            uptime_s=time.monotonic() - self.started,
            context=self.prompts.context.model_copy(),
            paused=self.loop.paused,
            replicas=[ReplicaInfo(**r) for r in self.engine.replica_status()],
            run_id=self.run_id,
            tool_calls=self.telemetry.tool_calls.status(),
            serve_only=self.settings.serve_only,
            tasks=self.telemetry.tasks.status(),
            adapters=self.loop.served.as_dict(),
        )

    @property
    def tinker(self) -> Service:
        """The Tinker API's operations over a workbench of their own (``tinker/``), made at the first call:
        a server nobody speaks Tinker to loads nothing for it."""
        if self._tinker is None:
            device = (self.settings.learner_device_list() or [self.settings.device])[0]
            root = (self.state.root if self.state is not None else Path(self.settings.state_dir)) / "tinker"
            bench = Workbench(
                Path(str(self.model_path)),
                self.engine.model_name,
                device,
                root,
                remote=self.mirror,
                full_clients=self.settings.tinker_full_clients,
            )
            self._tinker = Service(bench, bench.vocab, self.engine.max_context)
        return self._tinker

    def close(self, checkpoint: bool = True) -> None:
        """Stop training (saving a last checkpoint unless ``checkpoint`` is False), then serving."""
        if self._tinker is not None:
            self._tinker.bench.close()
        saving = checkpoint and self.state is not None
        if self.settings.serve_only:  # nothing was trained: no step to end, nothing to checkpoint
            logger.warning("shutting down: the requests in flight end, then the engine")
        else:
            logger.warning("shutting down: the step in progress ends%s", ", then a last checkpoint" if saving else "")
        self.loop.close(checkpoint=checkpoint)
        version, step = self.loop.live
        newest = self.state.latest() if self.state is not None else None
        if self.settings.serve_only:
            logger.warning("stopped serving policy v%d (--serve-only: it never trains)", version)
        else:
            logger.warning(
                "stopped at step %d, policy v%d; %s",
                step,
                version,
                f"newest checkpoint {newest.path.resolve()} (`up --resume` continues from it)"
                if newest is not None
                else "no checkpoint written",
            )
        if self._ticker is not None:
            self._ticker.close()
            self.telemetry.tick(self.snapshot())  # the run's last figures
        self.telemetry.history.close()
        self.engine.close()
        if self.mirror is not None:  # the last checkpoint is written: upload it (unless crashing)
            self.mirror.close(flush=checkpoint)
        if self.log is not None:
            self.log.close()
        if self.state is not None:
            self.state.close()


def create_runtime(
    engine: Engine,
    settings: ServerSettings,
    model_path: str,
    ctx: DistContext | None = None,
    state: StateDir | None = None,
    start: bool = True,
) -> SwarmRuntime:
    """Open (or take) the state dir, restore the live configuration an earlier run was given through the
    admin API, build the learner (from the newest checkpoint when resuming), replay the log into the
    buffer and start training (``start`` False: the caller calls ``SwarmRuntime.start``, say after looking
    at what a resumed run restored); with ``--serve-only`` no learner and no training loop."""
    state = state or open_state_dir(settings)
    log: TrajectoryLog | None = None
    mirror = StateMirror(state.remote, state, settings) if state.remote is not None else None
    try:
        log = TrajectoryLog(state.log_dir)
        if mirror is not None:
            mirror.attach(log)
        settings, live = _restored(state, log, settings)
        learner, vocab = _learner(engine, settings, model_path, ctx, state)
        set_static_ids(run_id=state.run_id)  # --log-format json: on every line
        signer = SampleSigner.load(state.root / SAMPLE_KEY, renew=settings.fresh)  # --fresh: a new key
        parser = load_parser(Path(model_path), settings.tool_call_parser, settings.reasoning_parser)
        opened = Opened(signer, _history(settings, state), parser, state, Path(model_path), live, log, mirror)
        runtime = SwarmRuntime(engine, settings, learner, vocab, opened)
        if state.resuming and runtime.recovery is not None:
            runtime.replayed = runtime.recovery.replay(runtime.loop, settings.model_dump(mode="json"))
        runtime.recent.load(log.directory)
        if mirror is not None:
            mirror.upload_run_files(runtime.run_id)
    except BaseException:
        if mirror is not None:
            mirror.close(flush=False)
        if log is not None:
            log.close()
        state.close()
        raise
    if start:
        runtime.start()
    return runtime


def _restored(
    state: StateDir, log: TrajectoryLog, settings: ServerSettings
) -> tuple[ServerSettings, LiveConfiguration]:
    """The settings with what an earlier run was given through the admin API (when resuming), and that
    configuration."""
    if not state.resuming:
        return settings, LiveConfiguration({})
    live = restored_configuration(state, log)
    if live.changed:
        logger.warning(
            "restoring settings changed through the admin API before the restart: %s",
            ", ".join(f"{k}={v}" for k, v in live.changed.items()),
        )
        settings = settings.model_copy(update=live.changed)
    if live.paused:
        logger.warning("learning stays paused, as the admin API left it (agentjet-server admin resume)")
    return settings, live


def _learner(
    engine: Engine, settings: ServerSettings, model_path: str, ctx: DistContext | None, state: StateDir
) -> tuple[Learner | None, int]:
    """The learner (none with --serve-only), from the newest checkpoint when resuming, the engine given that
    checkpoint's weights, and the model's vocabulary size."""
    checkpoint = state.resumed
    trainer_state = checkpoint.trainer_state() if checkpoint is not None else None
    learner = None if settings.serve_only else build_learner(settings, model_path, ctx, resume_from=trainer_state)
    if checkpoint is not None and engine.adapters:
        # an adapter per agent: the engine holds the base; each adapter's weights at its own version
        assert trainer_state is not None
        counts = checkpoint.meta.adapter_versions
        for name, tensors in trainer_state["adapters"].items():
            engine.update_named_adapter(name, tensors, counts.get(name, 0))
    elif checkpoint is not None and engine.version != checkpoint.meta.version:
        # an engine built from the original model: give it the checkpoint's weights and version
        assert trainer_state is not None
        if engine.serves_adapters:  # the base model, and the trained adapter
            engine.update_adapter(trainer_state["adapter"], checkpoint.meta.version)
        else:
            engine.update_weights(trainer_state["weights"], checkpoint.meta.version)
    if learner is not None:
        model: Any = learner.model
        return learner, int(model.config.vocab_size)
    from transformers import AutoConfig  # --serve-only: a frozen model, served as it is (or as its newest checkpoint)

    logger.warning("serving only (--serve-only): pushed trajectories are refused and nothing is trained")
    return None, int(AutoConfig.from_pretrained(model_path).vocab_size)


def _history(settings: ServerSettings, state: StateDir) -> History:
    """The metrics file (emptied for a new run) and its sinks; nothing is written without --metrics."""
    if not settings.metrics:
        return History(None, [])
    metrics_file = state.root / METRICS_FILE
    if not state.resuming:
        metrics_file.unlink(missing_ok=True)  # a new run: no earlier figures (a run that logged nothing)
    return History(metrics_file, open_sinks(settings.log_to, state.root, public_settings(settings)))
