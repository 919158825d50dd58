"""Steering a running server: the admin API's operations (``/v1/admin/...``), over the runtime.

* ``config`` / ``change``: the effective configuration, and changes to the settings a running
  server can take (``LIVE``): each is validated as the whole configuration would be at start,
  written to the trajectory log (so ``--resume`` restores it) and applied: learner settings from
  the next step, the others at once.
* ``pause`` / ``resume``: learning stops after the step in progress, and starts again; serving and
  ingestion go on (the buffer fills up to its bound, then pushes get 429 as usual).
* ``checkpoint``: written by the learner thread after the step in progress.

Routes check that the caller holds an admin key; nothing here knows about HTTP.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from agentjet_client.protocol import AdminConfig, AdminState, AdoptInfo, CheckpointInfo, ConfigChange
from agentjet_server.batching.buffer import GroupBuffer
from agentjet_server.engine.adapter import LoraSpec
from agentjet_server.errors import InvalidRequestError, StateError
from agentjet_server.ingest.store import TrajectoryStore
from agentjet_server.ingest.wal import Configured
from agentjet_server.learner.loop import TrainingLoop
from agentjet_server.learner.trainer import LearnerConfig
from agentjet_server.observe.metrics import History
from agentjet_server.serving import PromptBuilder
from agentjet_server.settings import ServerSettings, live_settings
from agentjet_server.state.recovery import LiveConfiguration

logger = logging.getLogger(__name__)

# settings a running server takes, and what each changes (declared on ServerSettings' fields)
LIVE = live_settings()
SECRET = ("api_keys", "admin_keys")


def learner_config(settings: ServerSettings, base: LearnerConfig | None = None) -> LearnerConfig:
    """The learner's settings as ``settings`` gives them (the rest of ``base`` unchanged)."""
    return dataclasses.replace(
        base or LearnerConfig(),
        lr=settings.lr,
        clip_low=settings.clip_low,
        clip_high=settings.clip_high,
        max_grad_norm=settings.max_grad_norm,
        entropy_coef=settings.entropy_coef,
        algorithm=settings.algorithm,
        advantage=settings.advantage or ("gae" if settings.algorithm == "ppo" else "grpo"),
        mask_truncated=settings.mask_truncated,
        overlong_buffer=settings.overlong_buffer,
        overlong_penalty=settings.overlong_penalty,
        off_policy=settings.off_policy,
        is_cap=settings.is_cap,
        policy_loss=settings.policy_loss,
        cispo_cap=settings.cispo_cap,
        sapo_tau_pos=settings.sapo_tau_pos,
        sapo_tau_neg=settings.sapo_tau_neg,
        dro_beta=settings.dro_beta,
        loss_aggregation=settings.loss_aggregation,
        loss_norm_length=settings.loss_norm_length,
        token_mask=settings.token_mask,
        sequence_mask=settings.sequence_mask,
        sequence_is=settings.sequence_is,
        mismatch_kl_coef=settings.mismatch_kl_coef,
        kl_coef=settings.kl_coef,
        distill_coef=settings.distill_coef if settings.teacher is not None else 0.0,
        distill_loss=settings.distill_loss,
        mini_batches=settings.mini_batches,
        gamma=settings.gamma,
        lam=settings.lam,
        vf_coef=settings.vf_coef,
        advantage_norm=settings.advantage_norm,
        compute_dtype=settings.learner_dtype,
        gradient_checkpointing=settings.gradient_checkpointing,
        cpu_offload=settings.cpu_offload,
        micro_batch_tokens=settings.micro_batch_tokens,
        lora=(
            LoraSpec(
                rank=settings.lora_rank,
                alpha=settings.lora_alpha or 2.0 * settings.lora_rank,
                dropout=settings.lora_dropout,
                targets=settings.lora_targets,
            )
            if settings.lora_rank
            else None
        ),
        adapters=settings.adapter_names(),
    )


def public_settings(settings: ServerSettings) -> dict[str, Any]:
    """Every setting as JSON, keys redacted (what ``GET /v1/admin/config`` and the dashboard show)."""
    data = settings.model_dump(mode="json")
    for name in SECRET:
        data[name] = [f"...{k[-4:]}" if len(k) >= 16 else "***" for k in data[name]]
    return data


def check_changes(current: ServerSettings, changes: Mapping[str, Any]) -> ServerSettings:
    """``current`` with ``changes``, validated as at start; InvalidRequestError names what is wrong."""
    if not isinstance(changes, Mapping) or not changes:
        raise InvalidRequestError(
            'send a JSON object of the settings to change, e.g. {"lr": 0.0005}; live settings: ' + ", ".join(LIVE)
        )
    for name in changes:
        if name not in LIVE:
            known = name in ServerSettings.model_fields
            raise InvalidRequestError(
                (
                    f"'{name}' cannot be changed while the server runs (restart it with the new value)"
                    if known
                    else f"'{name}' is not a setting of this server"
                )
                + "; settings a running server takes: "
                + ", ".join(LIVE),
                param=name,
                code="not_live" if known else "unknown_setting",
            )
    try:
        return ServerSettings.model_validate({**current.model_dump(), **dict(changes)})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or next(iter(changes))
        raise InvalidRequestError(
            f"{where}: {str(first['msg']).removeprefix('Value error, ')} (got {changes.get(where, '?')!r})",
            param=where,
            code="invalid_value",
        ) from exc


class Controller:
    """The admin operations. ``settings`` is read and replaced through ``get_settings`` /
    ``set_settings`` (the runtime owns it)."""

    def __init__(
        self,
        *,
        get_settings: Callable[[], ServerSettings],
        set_settings: Callable[[ServerSettings], None],
        loop: TrainingLoop,
        store: TrajectoryStore,
        buffer: GroupBuffer,
        prompts: PromptBuilder,
        history: History,
        live: LiveConfiguration,
    ) -> None:
        self._get, self._set = get_settings, set_settings
        self.loop, self.store, self.buffer, self.prompts, self.history = loop, store, buffer, prompts, history
        self.live = live
        self.changes: list[ConfigChange] = []
        loop.paused = live.paused

    def config(self) -> AdminConfig:
        return AdminConfig(
            config=public_settings(self._get()),
            live=list(LIVE),
            changes=list(self.changes),
            paused=self.loop.paused,
        )

    def apply(self, settings: ServerSettings) -> None:
        """Hand ``settings``' live values to the parts that use them (also at start, after a resume)."""
        if self.loop.learner is not None:  # --serve-only: no learner to configure
            self.loop.reconfigure(learner_config(settings, self.loop.learner.config))
        self.loop.checkpoints.every = settings.checkpoint_every
        self.store.max_staleness = settings.max_staleness
        self.loop.max_staleness = settings.max_staleness
        self.loop.stale_policy = settings.stale_policy
        self.buffer.resize(settings.group_size, settings.batch_groups, settings.group_timeout_s)
        self.prompts.default_max_tokens = settings.default_max_tokens

    def change(self, changes: Mapping[str, Any]) -> AdminConfig:
        current = self._get()
        if self.loop.learner is None:
            raise InvalidRequestError(
                "this server runs with --serve-only: it trains nothing, there is nothing to change"
            )
        updated = check_changes(current, changes)
        if updated.kl_coef > 0 and self.loop.learner.reference is None:
            raise InvalidRequestError(
                "kl_coef: this server has no reference model (it started with --kl-coef 0); restart it with "
                "--kl-coef above 0 (and --resume) to add a KL penalty"
            )
        before, after = current.model_dump(mode="json"), updated.model_dump(mode="json")
        changed = {k: after[k] for k in changes if after[k] != before[k]}
        if changed:
            live = LiveConfiguration({**self.live.changed, **changed}, self.loop.paused)
            self._record({k: before[k] for k in changed}, changed, live)
            self._set(updated)
            self.apply(updated)
        return self.config()

    def pause(self, paused: bool) -> AdminState:
        if paused != self.loop.paused:
            live = LiveConfiguration(dict(self.live.changed), paused)
            self._record({"paused": self.loop.paused}, {"paused": paused}, live)
            self.loop.paused = paused
            self.buffer.wake()
        version, step = self.loop.live
        return AdminState(
            paused=paused,
            step=step,
            policy_version=version,
            message=(
                "learning paused after the step in progress; serving and ingestion go on"
                if paused
                else "learning goes on"
            ),
        )

    def checkpoint(self, timeout: float = 600.0) -> CheckpointInfo:
        """Ask the learner thread for a checkpoint and wait for it (call from a worker thread)."""
        started = time.perf_counter()
        path = self.loop.request_checkpoint().result(timeout=timeout)
        if path is None:
            raise StateError("no checkpoint was written (this server has no state dir)")
        version, _ = self.loop.live
        return CheckpointInfo(
            step=self.loop.saved_step,
            policy_version=version,
            path=str(Path(path).resolve()),
            seconds=time.perf_counter() - started,
        )

    def adopt(self, source: str, timeout: float = 600.0) -> AdoptInfo:
        """Take another run's checkpoint (weights and optimizer state) after the step in progress,
        keep this run's settings and step count, serve it as a new policy version, checkpoint
        (call from a worker thread). Population-based training's exploit step."""
        from agentjet_server.learner.resume import check_donor
        from agentjet_server.learner.training import adopt
        from agentjet_server.state.checkpoint import read_checkpoint

        learner = self.loop.learner
        if learner is None:
            raise InvalidRequestError("this server runs with --serve-only: it has no learner to load weights into")
        if learner.ctx.enabled:
            raise InvalidRequestError(
                "adopting a checkpoint is not supported with a multi-rank learner (torchrun) yet; stop this server "
                "and start it with --resume on a copy of the other run's state dir"
            )
        if not isinstance(source, str) or not source:
            raise InvalidRequestError(
                'give the checkpoint to take: {"checkpoint": "<state-dir>/checkpoints/step-N"} (or a state dir: '
                "its newest checkpoint)",
                param="checkpoint",
            )
        started = time.perf_counter()
        try:
            checkpoint = read_checkpoint(Path(source))
            state = checkpoint.trainer_state()
            check_donor(learner.model, learner.policy, learner.lora, state)
        except (StateError, ValueError, OSError, RuntimeError) as exc:
            raise InvalidRequestError(f"checkpoint {source}: {exc}", param="checkpoint") from exc
        version, saved = self.loop.requests.call(lambda: adopt(self.loop, state)).result(timeout=timeout)
        step = self.loop.live[1]
        self.history.append(
            "adopt", source=str(checkpoint.path), source_step=checkpoint.meta.step, step=step, policy_version=version
        )
        logger.warning("admin: adopted %s (step %d of its run) as v%d", checkpoint.path, checkpoint.meta.step, version)
        return AdoptInfo(
            source=str(checkpoint.path.resolve()),
            source_step=checkpoint.meta.step,
            step=step,
            policy_version=version,
            checkpoint=str(Path(saved).resolve()) if saved else None,
            seconds=time.perf_counter() - started,
        )

    def _record(self, previous: dict[str, Any], changed: dict[str, Any], live: LiveConfiguration) -> None:
        """Durable first (StateError: nothing applied), then in memory and in the history."""
        change = ConfigChange(at=time.time(), step=self.loop.live[1], changes=changed, previous=previous)
        self.store.log_change(Configured(change.model_dump(mode="json"), dict(live.changed), live.paused))
        self.live = live
        self.changes.append(change)
        self.history.append("config", changes=changed, previous=previous, step=change.step)
        logger.info(
            "admin: %s",
            ", ".join(f"{k} {previous.get(k)} -> {v}" for k, v in changed.items()),
        )
