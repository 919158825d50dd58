"""The server's moving parts wired together: engine, chat service, ingestion, learner loop.

``SwarmRuntime`` owns what lives for the whole process; routes (``app``) only translate HTTP to
calls on it. Build it with ``SwarmRuntime.create(engine, settings)``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from agentjet_client.protocol import (
    LearnerInfo,
    ServerStatus,
    TrajectoryBatch,
    TrajectoryBatchResult,
)
from agentjet_server.batching.buffer import GroupBuffer
from agentjet_server.engine.base import Engine
from agentjet_server.learner.distributed import DistContext
from agentjet_server.learner.loop import TrainingLoop
from agentjet_server.learner.trainer import Learner, LearnerConfig
from agentjet_server.serving import ChatService
from agentjet_server.settings import ServerSettings
from agentjet_server.store import TrajectoryStore

logger = logging.getLogger(__name__)


def trainable_copy(model_path: str, device: str) -> torch.nn.Module:
    """A separate fp32 model for the learner, from the same checkpoint the engine loaded."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model = model.to(device)
    model.eval()
    return model  # type: ignore[no-any-return]


def build_learner(settings: ServerSettings, model_path: str, ctx: DistContext | None = None) -> Learner:
    """The learner every rank builds identically (same seed, same checkpoint)."""
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
    return Learner(model, config, pad_id=int(config_pad or 0), ctx=ctx)


class SwarmRuntime:
    def __init__(self, engine: Engine, settings: ServerSettings, learner: Learner, vocab_size: int) -> None:
        self.engine = engine
        self.settings = settings
        self.chat = ChatService(engine, default_max_tokens=settings.default_max_tokens)
        self.buffer = GroupBuffer(settings.group_size, settings.batch_groups)
        self.store = TrajectoryStore(vocab_size, settings.max_staleness, self.buffer.add)
        self.loop = TrainingLoop(
            learner, self.buffer, engine, version=engine.version, on_trained=self.store.mark_trained
        )
        self.started = time.monotonic()

    @classmethod
    def create(
        cls, engine: Engine, settings: ServerSettings, model_path: str, ctx: DistContext | None = None
    ) -> SwarmRuntime:
        learner = build_learner(settings, model_path, ctx)
        model: Any = learner.model
        vocab_size = int(model.config.vocab_size)
        runtime = cls(engine, settings, learner, vocab_size)
        runtime.loop.start()
        return runtime

    @property
    def version(self) -> int:
        return self.loop.version

    def ingest(self, batch: TrajectoryBatch) -> TrajectoryBatchResult:
        results = [self.store.admit(t, self.version) for t in batch.trajectories]
        return TrajectoryBatchResult(results=results, policy_version=self.version)

    def admission_budget(self) -> int:
        s = self.settings
        target = s.batch_groups * s.group_size * s.admission_batches
        return max(0, target - self.buffer.buffered)

    def status(self) -> ServerStatus:
        last = self.loop.last
        return ServerStatus(
            model=self.engine.model_name,
            policy_version=self.version,
            trajectories=self.store.counts(self.buffer.buffered),
            learner=LearnerInfo(
                algorithm=self.settings.algorithm,
                step=self.loop.learner.steps,
                batch_groups=self.settings.batch_groups,
                group_size=self.settings.group_size,
                max_staleness=self.settings.max_staleness,
                last_loss=last.loss if last else None,
                last_step_seconds=last.seconds if last else None,
                last_mean_reward=last.mean_reward if last else None,
                skipped_batches=self.loop.skipped_batches,
                last_error=self.loop.error,
            ),
            admission_budget=self.admission_budget(),
            uptime_s=time.monotonic() - self.started,
        )

    def close(self) -> None:
        self.loop.close()
        self.engine.close()
