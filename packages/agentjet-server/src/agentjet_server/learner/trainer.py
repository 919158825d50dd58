"""One policy update over a batch of trajectory groups (``learner.batch.build_batch``), top to bottom, through
four files besides this one, none of which calls back into another:

1. ``Learner.plan`` packs the batch's sequences into prefix trees (``learner.packing``: shared prefixes such
   as a group's prompt are computed once), split into ``mini_batches`` (one optimizer step each) and, under
   torchrun, between ranks.
2. ``learner.prepare`` — one forward pass without gradient, before any weight changes, where the objective
   needs it: the *proximal* log-probs of the weights about to be updated (the decoupled objective), the
   frozen reference model's log-probs (KL penalty), the critic's values then GAE and advantage whitening
   (PPO), the teacher's per-token advantage (distillation); for DPO, each sequence's pair weight.
3. For each epoch and mini-batch: each micro-batch's loss (``learner.objective``: the policy objective of
   ``--off-policy`` plus the KL, value and entropy terms, normalised by the mini-batch's trained tokens);
   gradients accumulate; clip; one AdamW step.

Every forward pass is ``learner.policy``'s (the model with its output head only at trained tokens, in the
learner's precision, with the learner's attention). The server runs this in a background thread
(``learner.loop``); it runs on its own, too:

    learner = Learner(model, LearnerConfig(lr=1e-3), pad_id=0)
    stats = learner.step(build_batch(groups))
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from agentjet_server.engine.lora_layers import activate, adapter_of, attach, attach_adapters
from agentjet_server.learner.batch import Batch, Mode, Sequence
from agentjet_server.learner.config import LearnerConfig, OffPolicy
from agentjet_server.learner.distributed import (
    DistContext,
    decoder_layers,
    full_state_dict,
    partition,
    shard_model,
)
from agentjet_server.learner.lora import adapter_state, merged
from agentjet_server.learner.objective import mismatch_figures, objective
from agentjet_server.learner.packing import DENSE_TREE_MAX, MicroBatch, MiniBatch, Packed, pack
from agentjet_server.learner.policy import PolicyModel, frozen, use_learner_attention
from agentjet_server.learner.prepare import prepare, sequence_sums, weigh_pairs
from agentjet_server.learner.resume import load_training_state, training_state
from agentjet_server.learner.teacher import RemoteTeacher

__all__ = ["Learner", "LearnerConfig", "MiniBatch", "OffPolicy", "StepStats"]


@dataclass
class StepStats:
    loss: float
    mean_reward: float
    sequences: int
    trained_tokens: int
    grad_norm: float
    seconds: float
    extra: dict[str, float] = field(default_factory=dict)
    processed_tokens: int = 0  # prefix-tree nodes the forward passes ran over
    micro_batches: int = 0
    prepare_seconds: float = 0.0  # the no-gradient pass (proximal, reference, values)


class Learner:
    """Holds the trainable model (and the value head, for PPO), its optimizer and the frozen
    reference model (for a KL penalty); ``step`` is one policy update.

    With a ``DistContext`` of several ranks (see ``learner.distributed``) the model is sharded
    with FSDP2 and every rank must call ``step`` and ``full_state_dict`` on the same batches.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config: LearnerConfig,
        pad_id: int,
        ctx: DistContext | None = None,
        reference: torch.nn.Module | None = None,
        teacher: torch.nn.Module | None = None,
        remote_teacher: RemoteTeacher | None = None,
    ) -> None:
        """``teacher``: a local distillation teacher, which scores the packed micro-batches; or
        ``remote_teacher``, one behind HTTP, which the loop asks to score each batch's sequences before the
        step (``Sequence.teacher_logprobs``)."""
        if config.kl_coef > 0 and reference is None:
            raise ValueError("a KL penalty (kl_coef > 0) needs a reference model")
        if config.distill_coef > 0 and teacher is None and not remote_teacher:
            raise ValueError("distillation (distill_coef > 0) needs a teacher model")
        if config.distill_loss == "full" and teacher is None:
            raise ValueError("the full-vocabulary distillation loss needs the teacher's logits: a local teacher")
        self.model = model
        self.config = config
        self.pad_id = pad_id
        self.ctx = ctx or DistContext(device=str(next(model.parameters()).device))
        # where micro-batches go: offloaded weights may sit in host memory while compute is on ctx.device
        self.device = torch.device(self.ctx.device) if config.cpu_offload else next(model.parameters()).device
        self.lora = config.lora
        use_learner_attention(model)  # fp32 on CUDA: attention linear in length (see learner.policy)
        if config.adapters and self.lora is None:
            raise ValueError("an adapter per agent needs LoRA: give --lora-rank")
        if config.adapters and (self.ctx.enabled or config.cpu_offload):
            raise ValueError("an adapter per agent runs in one learner process, without --cpu-offload")
        if self.lora is not None and config.adapters:
            attach_adapters(model, self.lora, config.adapters)
        elif self.lora is not None:
            attach(model, self.lora)  # in place: ``model`` keeps its interface, only the adapter trains
        if config.gradient_checkpointing:
            _checkpoint_layers(model)
        bfloat16 = config.compute_dtype == "bfloat16"
        self.policy = PolicyModel(model, value_head=config.algorithm == "ppo", bf16=bfloat16)
        self.policy.device_type = self.device.type
        # sharded (several ranks, or offloaded): FSDP gathers each unit collectively, once per pass
        self.sharded = shard_model(self.policy, decoder_layers(model), self.ctx, offload=config.cpu_offload)
        # the value head learns from scratch while the policy is fine-tuned: it gets its own gradient
        # clipping (the policy's gradient norm, often far above the bound, would scale it away)
        self._head = list(self.policy.value_head.parameters()) if self.policy.value_head is not None else []
        head_ids = {id(p) for p in self._head}
        trainable = [p for p in self.policy.parameters() if p.requires_grad]
        self._trunk = [p for p in trainable if id(p) not in head_ids]
        self.optimizer = torch.optim.AdamW(trainable, lr=config.lr, weight_decay=config.weight_decay)
        self.reference = frozen(reference, self.policy)
        self.teacher = frozen(teacher, self.policy)
        self.remote_teacher = remote_teacher
        self.idle = _idle_micro_batch(pad_id, self.device)
        self.steps = 0

    def release_gradients(self) -> None:
        """Free the last step's gradients (the next step starts from none anyway): between steps the
        memory is the engine's, or a sleeping engine's to take back."""
        self.optimizer.zero_grad(set_to_none=True)

    def reconfigure(self, config: LearnerConfig) -> None:
        """Take new settings between steps: the learning rate goes to the optimizer at once."""
        if config.algorithm != self.config.algorithm:
            raise ValueError("the algorithm of a learner cannot change (it decides whether there is a critic)")
        if config.cpu_offload != self.config.cpu_offload:
            raise ValueError("where the learner's state lives (--cpu-offload) is fixed when it starts")
        if config.kl_coef > 0 and self.reference is None:
            raise ValueError("a KL penalty needs a reference model: start the server with --kl-coef above 0")
        if config.distill_coef > 0 and self.teacher is None and self.remote_teacher is None:
            raise ValueError("distillation needs a teacher: start the server with --teacher DIR or URL")
        for group in self.optimizer.param_groups:
            group["lr"] = config.lr
            group["weight_decay"] = config.weight_decay
        for policy in (self.policy, self.reference, self.teacher):
            if policy is not None:
                policy.compute_bf16 = config.compute_dtype == "bfloat16"
        self.config = config

    def sequence_logprobs(self, batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probability of each trained entry's token, and the policy's entropy there, ``[E]``."""
        logprobs, entropy, _values = self.policy.run(batch)
        return logprobs, entropy

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's weights on CPU (gathered from every rank; empty on ranks other than 0),
        under the model's own names: with LoRA, each adapter merged into its base weight."""
        if self.config.adapters:
            raise ValueError("with an adapter per agent there is no one merged model: take adapter_weights(name)")
        state = full_state_dict(self.model, self.ctx)
        return merged(state, self.lora) if self.lora is not None and state else state

    def adapter_weights(self, name: str | None = None) -> dict[str, torch.Tensor]:
        """With LoRA: the adapter's tensors on CPU (collective under FSDP, like ``full_state_dict``); with
        an adapter per agent, those of adapter ``name``."""
        if self.lora is None:
            raise ValueError("the learner trains every weight (no --lora-rank): it has no adapter")
        if self.config.adapters:
            if name not in self.config.adapters:
                raise ValueError(f"no adapter {name!r}: this learner has {', '.join(self.config.adapters)}")
            params = self.model.named_parameters()  # that adapter's alone: no copy of the whole model
            return {key: p.detach().to("cpu", copy=True) for key, p in params if adapter_of(key) == name}
        return adapter_state(full_state_dict(self.model, self.ctx))

    @property
    def trainable_parameters(self) -> int:
        return sum(p.numel() for group in self.optimizer.param_groups for p in group["params"])

    def training_state(self) -> dict[str, Any]:
        """Everything a resumed learner needs, whole, on rank 0 (``learner.resume``; collective under FSDP)."""
        return training_state(self.model, self.policy, self.optimizer, self.ctx, self.lora, self.steps)

    def load_training_state(self, state: dict[str, Any] | None) -> None:
        """Inverse of ``training_state``: rank 0 passes the state, the others ``None`` (collective)."""
        self.steps = load_training_state(self.model, self.policy, self.optimizer, self.ctx, self.lora, state)

    # -- planning ---------------------------------------------------------------------------------

    def plan(self, sequences: list[Sequence], parts: int | None = None) -> tuple[list[MiniBatch], int]:
        """This rank's mini-batches (``parts``, the learner's ``mini_batches`` by default) of packed
        micro-batches, each padded with ``None`` to the largest count of any rank (FSDP gathers weights
        collectively, so every rank runs the same number of passes), and the tokens all ranks process."""
        # segment-wise trees run a varying number of decoder passes per micro-batch; FSDP gathers
        # each layer once per pass, collectively, so sharded ranks must all use one pass (dense)
        # a segment-wise tree carries keys and values between passes, which checkpointed layers don't keep
        mode = "dense" if self.sharded or self.config.gradient_checkpointing else self.config.tree_attention
        out: list[MiniBatch] = []
        processed = 0
        for chunk in _split(sequences, self.config.mini_batches if parts is None else parts):
            packed = pack(chunk, self.micro_batch_tokens)
            processed += sum(p.size for p in packed)
            shares = partition(packed, self.ctx.world_size, lambda p: p.size) if self.ctx.enabled else [packed]
            mine: list[MicroBatch | None] = [p.tensors(self.device, mode) for p in shares[self.ctx.rank]]
            mine += [None] * (max(len(s) for s in shares) - len(mine))
            out.append(MiniBatch(mine, float(sum(len(s.positions) for s in chunk)), float(len(chunk))))
        return out, processed

    @property
    def micro_batch_tokens(self) -> int:
        """Nodes per micro-batch: with checkpointed layers every tree runs dense, and a dense tree's
        attention grows with the square of its size, so trees stay at ``DENSE_TREE_MAX``."""
        if self.config.gradient_checkpointing:
            return min(self.config.micro_batch_tokens, DENSE_TREE_MAX)
        return self.config.micro_batch_tokens

    # -- the update -------------------------------------------------------------------------------

    def step(self, batch: Batch, adapter: str | None = None) -> StepStats:
        """One policy update on ``batch``; with an adapter per agent, of adapter ``adapter`` alone: the
        others need no gradient, get none, and AdamW skips parameters without one, so they stay as they
        were to the bit."""
        if not batch.sequences:
            raise ValueError("the batch has no trainable sequence (every group had equal rewards)")
        if adapter is not None or self.config.adapters:
            activate(self.model, adapter, self.config.adapters)
        started = time.perf_counter()
        # a DPO step's weights hold for the weights it starts from: one optimizer step
        plan, processed = self.plan(batch.sequences, 1 if batch.mode == "dpo" else None)
        tokens = sum(mini.tokens for mini in plan)  # the batch's trained tokens
        self.policy.eval()
        figures: dict[str, Any] = {}
        if batch.mode == "rl":  # a supervised loss needs no proximal, reference or value pass
            figures = prepare(self, plan, batch.version, tokens)
        elif batch.mode == "dpo":  # each sequence its own group (``learner.preference``)
            figures = weigh_pairs(self, plan, len(batch.sequences), batch.beta)
        prepare_seconds = time.perf_counter() - started
        self.policy.train()
        with _learning_rate(self.optimizer, batch.lr):
            loss_sum, extra, grad_norm = self._update(plan, batch.mode, tokens)
        if batch.mode == "rl":  # the trainer's log-probs against the sampler's, where the step had them
            figures.update(mismatch_figures([m for mini in plan for m in mini.micro if m is not None], self.ctx))
        extra.update(figures.pop("shares", {}))  # this rank's shares of the prepare pass's figures
        loss_sum, extra = _sum_over_ranks(self.ctx, loss_sum, extra)
        if "dpo_loss" in figures:  # the pair loss itself, not its per-token stand-in
            loss_sum = figures["dpo_loss"]
        extra.update(figures)
        self.policy.eval()
        self.steps += 1
        return StepStats(
            loss=loss_sum,
            mean_reward=sum(batch.rewards) / len(batch.rewards) if batch.rewards else math.nan,
            sequences=len(batch.sequences),
            trained_tokens=int(tokens),
            grad_norm=grad_norm,
            seconds=time.perf_counter() - started,
            extra=extra,
            processed_tokens=processed,
            micro_batches=sum(len(m.micro) for m in plan),
            prepare_seconds=prepare_seconds,
        )

    def score(self, batch: Batch, adapter: str | None = None) -> torch.Tensor:
        """(every rank) The summed log-prob of each of ``batch``'s sequences' trained tokens under the learner's
        weights (of ``adapter``, with an adapter per agent), in the batch's order; nothing is updated. Rank 0
        tells the other ranks (``distributed.Score``) before it calls this."""
        for number, sequence in enumerate(batch.sequences):
            sequence.group = number
        if adapter is not None or self.config.adapters:
            activate(self.model, adapter, self.config.adapters)
        plan, _ = self.plan(batch.sequences)
        self.policy.eval()
        return sequence_sums(self, plan, len(batch.sequences))[0]

    def _update(self, plan: list[MiniBatch], mode: Mode, batch_tokens: float) -> tuple[float, dict[str, float], float]:
        """The optimizer steps of one update: the loss, its figures and the last gradient norm."""
        loss_sum, grad_norm = 0.0, 0.0
        extra: dict[str, float] = {}
        teacher = self.teacher if self.config.distill_loss == "full" else None
        for epoch in range(self.config.epochs if mode == "rl" else 1):
            loss_sum = 0.0
            extra = {}
            for index, mini in enumerate(plan):
                self.optimizer.zero_grad(set_to_none=True)
                for planned in mini.micro:
                    part = planned if planned is not None else self.idle
                    part.fresh = epoch == 0 and index == 0  # no optimizer step has run yet
                    loss, stats = objective(self.config, self.policy, part, mini.tokens, mode, teacher, mini.sequences)
                    weight = float(part.entries) / batch_tokens
                    if planned is None:
                        loss, weight = loss * 0.0, 0.0
                    # FSDP averages gradients over ranks; each rank's loss is its share of the sum
                    (loss * self.ctx.world_size).backward()  # type: ignore[no-untyped-call]
                    loss_sum += float(loss.detach()) * mini.tokens / batch_tokens
                    for key, value in stats.items():
                        extra[key] = extra.get(key, 0.0) + value * weight
                norm = torch.nn.utils.clip_grad_norm_(self._trunk, self.config.max_grad_norm)
                grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
                if self._head:
                    torch.nn.utils.clip_grad_norm_(self._head, self.config.max_grad_norm)
                self.optimizer.step()
        return loss_sum, extra, grad_norm


@contextmanager
def _learning_rate(optimizer: torch.optim.Optimizer, lr: float | None) -> Iterator[None]:
    """The optimizer at learning rate ``lr`` (if given) for one update, at its own rate again after."""
    rates = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = lr if lr is not None else group["lr"]
    try:
        yield
    finally:
        for group, rate in zip(optimizer.param_groups, rates, strict=True):
            group["lr"] = rate


def _sum_over_ranks(ctx: DistContext, loss: float, extra: dict[str, float]) -> tuple[float, dict[str, float]]:
    if not ctx.enabled:
        return loss, extra
    import torch.distributed as dist

    keys = sorted(extra)
    values = torch.tensor([loss] + [extra[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(values)
    return float(values[0]), dict(zip(keys, values[1:].tolist(), strict=True))


def _checkpoint_layers(model: torch.nn.Module) -> None:
    """Recompute each decoder layer in the backward pass (non-reentrant checkpoints); transformers
    5 calls it activation checkpointing, 4 gradient checkpointing."""
    enable: Any = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
        return
    enable = getattr(model, "gradient_checkpointing_enable", None)
    if enable is None:
        raise ValueError("gradient checkpointing needs a Hugging Face model (activation_checkpointing_enable)")
    enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _split(sequences: list[Sequence], parts: int) -> list[list[Sequence]]:
    """``sequences`` in order, cut into at most ``parts`` runs of about equal trained tokens."""
    if parts <= 1 or len(sequences) <= 1:
        return [sequences]
    total = sum(len(s.positions) for s in sequences)
    out: list[list[Sequence]] = [[]]
    done = 0
    for seq in sequences:
        if out[-1] and len(out) < parts and done >= total * len(out) / parts:
            out.append([])
        out[-1].append(seq)
        done += len(seq.positions)
    return out


def _idle_micro_batch(pad_id: int, device: torch.device) -> MicroBatch:
    """A one-token stand-in micro-batch for a rank with no sequences left; its loss is scaled by 0."""
    stand_in = Packed()
    stand_in.insert(Sequence([pad_id, pad_id], [1], [0.0], [0.0]))
    micro = stand_in.tensors(device)
    micro.proximal_logprobs = micro.reference_logprobs = micro.old_logprobs
    micro.old_values = micro.returns = torch.zeros_like(micro.old_logprobs)
    return micro
