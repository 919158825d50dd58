"""One policy update over a batch of trajectory groups (``learner.batch.build_batch``), top to bottom.

1. ``Learner.step`` packs the batch's sequences into prefix trees (``learner.packing``: shared
   prefixes such as a group's prompt are computed once), split into ``mini_batches`` (one
   optimizer step each) and, under torchrun, between ranks.
2. ``Learner.prepare`` — one forward pass without gradient, before any weight changes, where the
   objective needs it: the *proximal* log-probs of the weights about to be updated (decoupled
   objective; the sampled log-probs are reused for tokens the current version sampled), the
   critic's values (PPO, then GAE per timeline and advantage normalisation: ``learner.advantages``),
   and the frozen reference model's log-probs (KL penalty).
3. For each epoch and mini-batch: forward each micro-batch with a tree attention mask, the policy
   objective of ``--off-policy`` (``learner.losses``) plus the KL, value and entropy terms,
   normalised by the mini-batch's trained tokens; gradients accumulate; clip; one AdamW step.

The server runs this in a background thread (``learner.loop``); it runs on its own, too:

    learner = Learner(model, LearnerConfig(lr=1e-3), pad_id=0)
    stats = learner.step(build_batch(groups))
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from agentjet_server.engine.adapter import LoraSpec
from agentjet_server.engine.lora_layers import activate, adapter_of, attach, attach_adapters
from agentjet_server.learner.advantages import ppo_advantages
from agentjet_server.learner.attention import use_learner_attention
from agentjet_server.learner.batch import Batch, Mode, Sequence
from agentjet_server.learner.distributed import (
    DistContext,
    decoder_layers,
    full_state_dict,
    partition,
    shard_model,
)
from agentjet_server.learner.lora import adapter_state, merged
from agentjet_server.learner.losses import (
    clipped_policy_loss,
    clipped_value_loss,
    decoupled_policy_loss,
    dpo_weights,
    k3_kl,
    tis_policy_loss,
)
from agentjet_server.learner.packing import DENSE_TREE_MAX, MicroBatch, Packed, pack
from agentjet_server.learner.policy import PolicyModel, chosen_and_entropy
from agentjet_server.learner.resume import load_training_state, training_state
from agentjet_server.learner.teacher import RemoteTeacher

OffPolicy = Literal["decoupled", "tis", "none"]


@dataclass(frozen=True)
class LearnerConfig:
    lr: float = 1e-3
    weight_decay: float = 0.0
    clip_low: float = 0.2
    clip_high: float = 0.28
    max_grad_norm: float = 1.0
    entropy_coef: float = 0.0  # bonus on the policy's entropy at trained positions
    epochs: int = 1  # passes over each batch; past the first, the clip keeps updates near the proximal policy
    mini_batches: int = 1  # optimizer steps per pass, each on its share of the batch's sequences
    micro_batch_tokens: int = 8192  # prefix-tree nodes per micro-batch
    tree_attention: str = "auto"  # dense | segments | auto (see learner.packing)
    algorithm: Literal["grpo", "ppo"] = "grpo"
    off_policy: OffPolicy = "decoupled"
    is_cap: float = 2.0  # truncation of the behaviour importance weight (decoupled, tis)
    kl_coef: float = 0.0  # k3 KL to the reference model; needs a reference
    # on-policy distillation: each sampled token's advantage gains this times log pi_teacher - log pi_behaviour
    # (the negative of the per-token reverse KL to the teacher); needs a teacher
    distill_coef: float = 0.0
    # "sampled": that advantage at each sampled token (the teacher's log-prob of it is all it needs, so a
    # teacher behind a URL does); "full": instead, the exact KL(student || teacher) over the whole vocabulary
    # at each sampled token's position, a loss term of its own (a local teacher's logits)
    distill_loss: Literal["sampled", "full"] = "sampled"
    gamma: float = 1.0  # PPO: discount per trained token
    lam: float = 0.95  # PPO: GAE lambda
    vf_coef: float = 0.5  # PPO: weight of the value loss
    value_clip: float = 0.2  # PPO: how far a value may move from its pre-update estimate
    advantage_norm: Literal["group", "batch"] = "group"  # PPO: whiten advantages per GRPO group or batch
    # bfloat16: forward and backward under autocast; the weights, their gradients and the AdamW
    # state keep the dtype the model was loaded in (fp32 master weights, or all bf16)
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    gradient_checkpointing: bool = False  # keep only each decoder layer's input; recompute the rest in backward
    lora: LoraSpec | None = None  # train a LoRA adapter on the frozen model instead of every weight
    adapters: tuple[str, ...] = ()  # with lora: one adapter per name, each step trains one (learner.adapters)
    # FSDP2 CPU offload (also in one process): weights, gradients and AdamW state in host memory, the
    # optimizer step on the CPU; each unit's weights are gathered onto the device to compute it
    cpu_offload: bool = False


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


@dataclass
class MiniBatch:
    """One optimizer step's share of the batch on this rank: its micro-batches (``None`` where
    this rank only joins the other ranks' collectives) and every rank's trained tokens together."""

    micro: list[MicroBatch | None]
    tokens: float


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
        use_learner_attention(model)  # fp32 on CUDA: attention linear in length (see learner.attention)
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
        self.policy = PolicyModel(model, value_head=config.algorithm == "ppo")
        # sharded (several ranks, or offloaded): FSDP gathers each unit collectively, once per pass
        self.sharded = shard_model(self.policy, decoder_layers(model), self.ctx, offload=config.cpu_offload)
        # the value head learns from scratch while the policy is fine-tuned: it gets its own gradient
        # clipping (the policy's gradient norm, often far above the bound, would scale it away)
        self._head = list(self.policy.value_head.parameters()) if self.policy.value_head is not None else []
        head_ids = {id(p) for p in self._head}
        trainable = [p for p in self.policy.parameters() if p.requires_grad]
        self._trunk = [p for p in trainable if id(p) not in head_ids]
        self.optimizer = torch.optim.AdamW(trainable, lr=config.lr, weight_decay=config.weight_decay)
        self.reference = _frozen(reference)
        self.teacher = _frozen(teacher)
        self.remote_teacher = remote_teacher
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
        self.config = config

    def sequence_logprobs(self, batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probability of each trained entry's token, and the policy's entropy there, ``[E]``."""
        with self.autocast():
            logprobs, entropy, _values = self.policy.run(batch)
        return logprobs, entropy

    def autocast(self) -> Any:
        """The learner's compute precision around a forward pass (backward follows it)."""
        wanted = self.config.compute_dtype == "bfloat16"
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=wanted)

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
            out.append(MiniBatch(mine, float(sum(s.trained_tokens for s in chunk))))
        return out, processed

    @property
    def micro_batch_tokens(self) -> int:
        """Nodes per micro-batch: with checkpointed layers every tree runs dense, and a dense tree's
        attention grows with the square of its size, so trees stay at ``DENSE_TREE_MAX``."""
        if self.config.gradient_checkpointing:
            return min(self.config.micro_batch_tokens, DENSE_TREE_MAX)
        return self.config.micro_batch_tokens

    def idle_pass(self) -> MicroBatch:
        """A one-token stand-in micro-batch for a rank with no sequences left; its loss is scaled by 0."""
        stand_in = Packed()
        stand_in.insert(Sequence([self.pad_id, self.pad_id], [1], [0.0], [0.0]))
        micro = stand_in.tensors(self.device)
        micro.proximal_logprobs = micro.reference_logprobs = micro.old_logprobs
        micro.old_values = micro.returns = torch.zeros_like(micro.old_logprobs)
        return micro

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
        self.policy.eval()
        preference: dict[str, Any] = {}
        if batch.mode == "rl":  # a supervised loss needs no proximal, reference or value pass
            preference = prepare(self, plan, batch.version, float(batch.trained_tokens))
        elif batch.mode == "dpo":
            preference = weigh_pairs(self, plan, batch)
        prepare_seconds = time.perf_counter() - started
        self.policy.train()
        idle = self.idle_pass()
        with _learning_rate(self.optimizer, batch.lr):
            loss_sum, extra, grad_norm = self._update(plan, batch, idle)
        extra.update(preference.pop("shares", {}))  # this rank's shares of the prepare pass's figures
        loss_sum, extra = _sum_over_ranks(self.ctx, loss_sum, extra)
        if "dpo_loss" in preference:  # the pair loss itself, not its per-token stand-in
            loss_sum = preference["dpo_loss"]
        extra.update(preference)
        self.policy.eval()
        self.steps += 1
        mean_reward = sum(batch.rewards) / len(batch.rewards) if batch.rewards else math.nan
        return StepStats(
            loss=loss_sum,
            mean_reward=mean_reward,
            sequences=len(batch.sequences),
            trained_tokens=batch.trained_tokens,
            grad_norm=grad_norm,
            seconds=time.perf_counter() - started,
            extra=extra,
            processed_tokens=processed,
            micro_batches=sum(len(m.micro) for m in plan),
            prepare_seconds=prepare_seconds,
        )

    def _update(self, plan: list[MiniBatch], batch: Batch, idle: MicroBatch) -> tuple[float, dict[str, float], float]:
        """The optimizer steps of one update: the loss, its figures and the last gradient norm."""
        batch_tokens = float(batch.trained_tokens)
        loss_sum, grad_norm = 0.0, 0.0
        extra: dict[str, float] = {}
        for _epoch in range(self.config.epochs if batch.mode == "rl" else 1):
            loss_sum = 0.0
            extra = {}
            for mini in plan:
                self.optimizer.zero_grad(set_to_none=True)
                for planned in mini.micro:
                    part = planned if planned is not None else idle
                    teacher = self.teacher if self.config.distill_loss == "full" else None
                    loss, stats = objective(
                        self.config, self.policy, part, mini.tokens, self.autocast, batch.mode, teacher
                    )
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


def prepare(learner: Learner, plan: list[MiniBatch], version: int | None, tokens: float = 1.0) -> dict[str, Any]:
    """(the no-gradient pass) Fill every micro-batch's proximal and reference log-probs and, for PPO, its
    values, GAE returns and whitened advantages, before the first update (see the module docstring); with
    a teacher, add its per-token advantage. Its figures: under "shares", this rank's shares (of the batch's
    ``tokens`` trained tokens) of the means that every rank's shares add up to."""
    config = learner.config
    micro = [m for mini in plan for m in mini.micro]
    real = [m for m in micro if m is not None]
    all_current = version is not None and all(bool((m.versions == version).all()) for m in real)
    # the same on every rank: each holds the whole batch's versions only for its share, so agree
    need_prox = config.off_policy == "decoupled" and not _all_ranks(learner.ctx, all_current)
    need_values = config.algorithm == "ppo"
    if need_prox or need_values:
        with torch.no_grad():
            for m in micro:
                part = m if m is not None else learner.idle_pass()
                with learner.autocast():
                    logprobs, _entropy, values = learner.policy.run(part)
                if m is None:
                    continue
                if need_prox:
                    current = (
                        m.versions == version if version is not None else torch.zeros_like(m.weights, dtype=torch.bool)
                    )
                    m.proximal_logprobs = torch.where(current, m.old_logprobs, logprobs)
                if values is not None:
                    m.old_values = values.float()
    for m in real:
        if m.proximal_logprobs is None:
            m.proximal_logprobs = m.old_logprobs
    if learner.reference is not None and config.kl_coef > 0:
        with torch.no_grad():
            for m in real:
                with learner.autocast():
                    m.reference_logprobs = learner.reference.run(m)[0]
    if need_values:
        ppo_advantages(real, config.gamma, config.lam, config.advantage_norm == "group", learner.ctx)
    if config.distill_coef <= 0 or (learner.teacher is None and learner.remote_teacher is None):
        return {}
    gaps = []
    with torch.no_grad():
        for m in real:
            if learner.teacher is not None:
                with learner.autocast():
                    scored = learner.teacher.run(m)[0].float()
            elif m.teacher_logprobs is None or bool(torch.isnan(m.teacher_logprobs).any()):
                raise ValueError("a token of this batch has no teacher log-prob: the remote teacher did not score it")
            else:
                scored = m.teacher_logprobs
            gaps.append(scored - m.old_logprobs)  # -(reverse KL) per sampled token
    # the baseline of a token is the mean gap of its group's tokens at the same depth (the siblings' choices
    # at that step, as GRPO's group mean is the rewards'): the advantages at each step then sum to zero, so
    # the tokens no sibling sampled are not all pushed up (or down) together, which AdamW, scaling each
    # weight's step to the same size whatever its gradient, would otherwise do to the whole vocabulary
    keys = [m.groups.cpu() * (1 << 32) + m.position_ids[0, m.entry_nodes].cpu() for m in real]
    sums: dict[int, list[float]] = {}
    for key, gap, m in zip(keys, gaps, real, strict=True):
        for k, g, w in zip(key.tolist(), gap.tolist(), m.weights.tolist(), strict=True):
            entry = sums.setdefault(k, [0.0, 0.0])
            entry[0] += g * w
            entry[1] += w
    gap_sum = sum(v[0] for v in sums.values())  # this rank's share, before the ranks' sums are merged
    if learner.ctx.enabled:
        import torch.distributed as dist

        every: list[dict[int, list[float]] | None] = [None] * learner.ctx.world_size
        dist.all_gather_object(every, sums)
        sums = {}
        for gathered in every:
            for k, (g, w) in (gathered or {}).items():
                entry = sums.setdefault(k, [0.0, 0.0])
                entry[0] += g
                entry[1] += w
    for key, gap, m in zip(keys, gaps, real, strict=True):
        baseline = torch.tensor([sums[k][0] / max(sums[k][1], 1e-12) for k in key.tolist()], dtype=gap.dtype)
        if config.distill_loss == "sampled":  # "full" is a loss term of its own (``objective``)
            m.advantages = m.advantages + config.distill_coef * (gap - baseline.to(gap.device))
    return {"shares": {"teacher_kl": -gap_sum / max(tokens, 1.0)}}


def sequence_sums(learner: Learner, plan: list[MiniBatch], count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the no-gradient pass, on every rank) For each of a batch's ``count`` sequences (``Sequence.group``
    numbers them), the weighted sum of its trained tokens' log-probs under the learner's weights, and of
    the batch's own ``old_logprobs`` of them, summed over every rank's share (float64, on the CPU)."""
    sums = torch.zeros(2, count, dtype=torch.float64)
    with torch.no_grad():
        for m in [m for mini in plan for m in mini.micro]:
            part = m if m is not None else learner.idle_pass()
            logprobs, _entropy = learner.sequence_logprobs(part)
            if m is None:
                continue
            index = m.groups.cpu()
            sums[0].index_add_(0, index, (logprobs.float() * m.weights).double().cpu())
            sums[1].index_add_(0, index, (m.old_logprobs * m.weights).double().cpu())
    if learner.ctx.enabled:
        import torch.distributed as dist

        dist.all_reduce(sums)
    return sums[0], sums[1]


def score(learner: Learner, batch: Batch, adapter: str | None = None) -> torch.Tensor:
    """(learner thread, every rank) The summed log-prob of each of ``batch``'s sequences' trained tokens under
    the learner's weights (of ``adapter``, with an adapter per agent), in the batch's order; nothing is
    updated. Rank 0 tells the other ranks (``distributed.Score``) before it calls this."""
    for number, sequence in enumerate(batch.sequences):
        sequence.group = number
    if adapter is not None or learner.config.adapters:
        activate(learner.model, adapter, learner.config.adapters)
    plan, _ = learner.plan(batch.sequences)
    learner.policy.eval()
    return sequence_sums(learner, plan, len(batch.sequences))[0]


def weigh_pairs(learner: Learner, plan: list[MiniBatch], batch: Batch) -> dict[str, float]:
    """(the no-gradient pass of a DPO step) Each entry's advantage becomes its sequence's DPO weight
    (``losses.dpo_weights``: the batch's ``old_logprobs`` carry each sequence's reference log-prob), and
    the step's figures."""
    logps, reference = sequence_sums(learner, plan, len(batch.sequences))
    weights, figures = dpo_weights(logps, reference, batch.beta)
    for m in [m for mini in plan for m in mini.micro if m is not None]:
        m.advantages = weights.to(device=m.advantages.device, dtype=m.advantages.dtype)[m.groups]
    return figures


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


def _frozen(model: torch.nn.Module | None) -> PolicyModel | None:
    """A model the learner only reads (the KL's reference, the distillation teacher)."""
    if model is None:
        return None
    use_learner_attention(model)
    model.requires_grad_(False)
    model.eval()
    return PolicyModel(model)


def _all_ranks(ctx: DistContext, flag: bool) -> bool:
    """``flag`` on every rank (the minimum over ranks)."""
    if not ctx.enabled:
        return flag
    import torch.distributed as dist

    value = torch.tensor([1 if flag else 0], dtype=torch.int64)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


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
    total = sum(s.trained_tokens for s in sequences)
    out: list[list[Sequence]] = [[]]
    done = 0
    for seq in sequences:
        if out[-1] and len(out) < parts and done >= total * len(out) / parts:
            out.append([])
        out[-1].append(seq)
        done += seq.trained_tokens
    return out


def objective(
    config: LearnerConfig,
    policy: PolicyModel,
    part: MicroBatch,
    tokens: float,
    autocast: Callable[[], Any],
    mode: Mode = "rl",
    teacher: PolicyModel | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """This micro-batch's share of its mini-batch's loss (normalised by the mini-batch's
    ``tokens``) and its figures (means over its entries): the policy objective of ``--off-policy``,
    plus the KL, value and entropy terms where they are on; for ``mode`` "sft" the negative
    log-likelihood of the trained tokens alone. With ``teacher`` (``distill_loss`` "full"), plus the exact
    KL(student || teacher) over the vocabulary at each trained position."""
    with autocast():
        distribution, values = policy.distribution(part)
    logprobs, entropy = chosen_and_entropy(distribution, part.targets)
    weights = part.weights
    if mode == "dpo":  # each sequence's weight (``weigh_pairs``) times its log-prob: the pair loss's gradient
        return -(logprobs.float() * part.advantages * weights).sum(), {"entropy": float(entropy.detach().mean())}
    if mode == "sft":
        nll = -(logprobs.float() * weights).sum()
        with torch.no_grad():
            figures = {"nll": float(nll.detach()) / max(float(weights.sum()), 1.0), "entropy": float(entropy.mean())}
        return nll / tokens, figures
    if config.off_policy == "decoupled":
        assert part.proximal_logprobs is not None
        loss, stats = decoupled_policy_loss(
            logprobs,
            part.proximal_logprobs,
            part.old_logprobs,
            part.advantages,
            weights,
            config.clip_low,
            config.clip_high,
            config.is_cap,
            normaliser=tokens,
        )
    elif config.off_policy == "tis":
        loss, stats = tis_policy_loss(
            logprobs, part.old_logprobs, part.advantages, weights, config.is_cap, normaliser=tokens
        )
    else:
        loss, stats = clipped_policy_loss(
            logprobs,
            part.old_logprobs,
            part.advantages,
            weights,
            config.clip_low,
            config.clip_high,
            normaliser=tokens,
        )
    if config.kl_coef > 0:
        assert part.reference_logprobs is not None
        kl = k3_kl(logprobs, part.reference_logprobs)
        loss = loss + config.kl_coef * (kl * weights).sum() / tokens
        stats["kl_reference"] = float(kl.detach().mean())
    if values is not None:
        assert part.old_values is not None and part.returns is not None
        value_loss, value_stats = clipped_value_loss(
            values, part.old_values, part.returns, weights, config.value_clip, normaliser=tokens
        )
        loss = loss + config.vf_coef * value_loss
        stats.update(value_stats)
    if config.entropy_coef:
        loss = loss - config.entropy_coef * (entropy * weights).sum() / tokens
    if teacher is not None:
        with torch.no_grad(), autocast():
            taught = teacher.distribution(part)[0]
        exact = (distribution.exp() * (distribution - taught)).sum(-1)  # [E] KL(student || teacher) per position
        loss = loss + config.distill_coef * (exact * weights).sum() / tokens
        stats["teacher_kl_exact"] = float(exact.detach().mean())
    with torch.no_grad():
        stats["entropy"] = float(entropy.mean())
    return loss, stats
