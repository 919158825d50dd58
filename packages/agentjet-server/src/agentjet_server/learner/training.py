"""The learner's work on data rather than on episodes: supervised fine-tuning and preference (DPO) updates,
scoring data without an update, and adopting another run's training state. Each runs on the learner thread
between two policy updates (``TrainingLoop.requests``), logged, served and recorded as a policy update is.

``Training`` is what the API calls (``api/train.py``, as the admin routes call ``control.Controller``): it
turns a request's data into a batch (``learner.supervised``, ``learner.preference``), hands the work to the
learner thread and answers with the figures; nothing here knows about HTTP.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any, Literal

import torch

from agentjet_server.engine.tokens import ChatTokenizer
from agentjet_server.errors import ConflictError, InvalidRequestError, StateError
from agentjet_server.learner import distributed
from agentjet_server.learner.batch import Batch
from agentjet_server.learner.loop import TrainingLoop, push_weights, train_part
from agentjet_server.learner.objective import dpo_weights
from agentjet_server.learner.preference import pairs_batch
from agentjet_server.learner.supervised import examples_batch
from agentjet_server.learner.trainer import StepStats
from agentjet_server.observe.steps import BatchFigures

TIMEOUT_S = 3600.0  # how long a request waits for the learner thread (a step in progress ends first)


@dataclass(frozen=True)
class DataStep:
    """What a request asks: a supervised ("sft") or preference ("dpo") update, or with ``evaluate`` only
    the loss, of ``adapter`` (with an adapter per agent), at learning rate ``lr`` (the server's if None)."""

    mode: Literal["sft", "dpo"]
    adapter: str | None = None
    evaluate: bool = False
    lr: float | None = None
    beta: float = 0.1  # "dpo": how far from the reference the preference may pull the policy


class Training:
    """Updates and scores on data, for the API (call from a worker thread: each waits for the learner)."""

    def __init__(self, loop: TrainingLoop, chat: ChatTokenizer) -> None:
        self.loop = loop
        self.chat = chat

    def run(self, step: DataStep, data: Any) -> dict[str, Any]:
        """One update on ``data`` (the request's examples or pairs), or its loss alone (``evaluate``), and the
        answer's figures."""
        batch, referenced = self._batch(step, data)
        tokens = batch.trained_tokens
        answer: dict[str, Any] = {"mode": step.mode, "evaluate": step.evaluate, "tokens": tokens}
        answer["adapter"] = step.adapter
        if step.evaluate:
            scores = self.loop.requests.call(lambda: score_batch(self.loop, batch, step.adapter)).result(TIMEOUT_S)
            if step.mode == "sft":
                return {**answer, "loss": -sum(scores) / max(tokens, 1)}
            return {**answer, **pair_figures(batch, scores, referenced)}
        stats = self.loop.requests.call(lambda: supervised_step(self.loop, batch, step.adapter)).result(TIMEOUT_S)
        version, trained = self.loop.live
        answer.update(loss=stats.extra.get("nll", stats.loss), grad_norm=stats.grad_norm)
        answer.update(step=trained, policy_version=version)
        if step.mode == "sft":
            answer["examples"] = len(batch.sequences)
        else:
            answer["pairs"] = len(batch.sequences) // 2
        answer.update({k: stats.extra[k] for k in ("reward_margin", "accuracy", "logp_margin") if k in stats.extra})
        return answer

    def _batch(self, step: DataStep, data: Any) -> tuple[Batch, bool]:
        """The request's data as a batch for the adapter it names, and whether its pairs carry their
        reference log-probs."""
        if self.loop.learner is None:
            raise ConflictError("this server runs with --serve-only and trains nothing")
        names, adapter = self.loop.trainer.config.adapters, step.adapter
        if (adapter is None) != (not names) or (adapter is not None and adapter not in names):
            wanted = f"one of its adapters ({', '.join(names)})" if names else "no adapter (it trains one model)"
            raise InvalidRequestError(
                f"this server's {step.mode} steps name {wanted}, not {adapter!r}", param="adapter"
            )
        if step.mode == "sft":
            batch, referenced = examples_batch(self.chat, data), False
        else:
            batch, referenced = pairs_batch(self.chat, data, step.beta, train=not step.evaluate)
        for sequence in batch.sequences:
            sequence.adapter = adapter
        batch.lr = step.lr
        return batch, referenced


def supervised_step(loop: TrainingLoop, batch: Batch, adapter: str | None = None) -> StepStats:
    """(learner thread) One update on a batch of data rather than of episodes (``mode`` "sft",
    ``learner.supervised``, or "dpo", ``learner.preference``; of ``adapter`` with an adapter per agent, at
    the batch's learning rate if it has one), logged, served and recorded as a policy update is (its
    record's ``mode`` says which)."""
    if loop.trainer.config.adapters and adapter not in loop.trainer.config.adapters:
        raise ValueError(
            f"this server trains an adapter per agent: name one of {', '.join(loop.trainer.config.adapters)}"
        )
    if not loop.log_version(loop.served.after_step([adapter] if adapter is not None else [])):
        raise StateError("the server is stopping; nothing was trained")
    return train_part(loop, batch, adapter, batch, BatchFigures({}, {}, Counter(), {}))


def score_batch(loop: TrainingLoop, batch: Batch, adapter: str | None = None) -> list[float]:
    """(learner thread) Each of ``batch``'s sequences' summed log-prob under the current weights (of
    ``adapter``), every learner rank taking part; nothing is updated."""
    if loop.trainer.ctx.enabled:
        distributed.broadcast(loop.trainer.ctx, distributed.Score(batch, adapter))
    return [float(x) for x in loop.trainer.score(batch, adapter)]


def pair_figures(batch: Batch, scores: list[float], referenced: bool) -> dict[str, Any]:
    """A scored DPO batch: each answer's log-prob and, with the pairs' reference log-probs, the DPO figures."""
    pairs = max(len(scores) // 2, 1)
    figures: dict[str, Any] = {
        "pairs": len(scores) // 2,
        "chosen_logps": scores[0::2],
        "rejected_logps": scores[1::2],
        "logp_margin": sum(scores[0::2]) / pairs - sum(scores[1::2]) / pairs,
    }
    if referenced:
        reference = torch.tensor([math.fsum(s.old_logprobs) for s in batch.sequences], dtype=torch.float64)
        _, pair = dpo_weights(torch.tensor(scores, dtype=torch.float64), reference, batch.beta)
        figures.update(loss=pair["dpo_loss"], reward_margin=pair["reward_margin"], accuracy=pair["accuracy"])
    return figures


def adopt(loop: TrainingLoop, state: dict[str, Any]) -> tuple[int, Any]:
    """(learner thread) Take another run's training state (population-based training's exploit): its
    weights and optimizer state; this run's settings and step count stay. The weights are served as a
    new policy version, then checkpointed (a restart continues from them). The version and the path."""
    trainer = loop.trainer
    steps, config = trainer.steps, trainer.config
    trainer.load_training_state(state)
    trainer.steps = steps
    trainer.reconfigure(config)
    versions = loop.served.after_step([])
    if not loop.log_version(versions):
        raise StateError("the server is stopping; nothing was adopted")
    version = versions.current
    push_weights(loop.engine, trainer, versions)
    loop.publish(versions, steps)
    return version, loop.checkpoint()
