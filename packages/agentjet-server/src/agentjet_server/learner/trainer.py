"""One GRPO step over a batch of trajectory groups, top to bottom.

1. ``build_batch`` — for each group, normalise rewards among its complete episodes
   (``group_advantages``); skip groups with no signal (all rewards equal). Every turn of every
   remaining episode becomes one sequence ``prompt + completion``; only completion tokens (the
   ones the policy sampled) are trained, each with its behaviour log-probability and the
   episode's advantage.
2. ``Learner.step`` — forward the sequences in micro-batches bounded by a token budget,
   compute ``clipped_policy_loss`` normalised by the batch's total trained tokens, accumulate
   gradients, clip the gradient norm, one AdamW step.

The server runs this in a background thread (``learner.loop``); it runs on its own, too:

    learner = Learner(model, LearnerConfig(lr=1e-3), pad_id=0)
    stats = learner.step(build_batch(groups))
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from agentjet_client.protocol import Trajectory
from agentjet_server.learner.distributed import (
    DistContext,
    decoder_layers,
    full_state_dict,
    partition,
    shard_model,
)
from agentjet_server.learner.losses import clipped_policy_loss, group_advantages


@dataclass(frozen=True)
class LearnerConfig:
    lr: float = 1e-3
    weight_decay: float = 0.0
    clip_low: float = 0.2
    clip_high: float = 0.28
    max_grad_norm: float = 1.0
    entropy_coef: float = 0.0  # bonus on the policy's entropy at trained positions
    epochs: int = 1  # optimizer steps per batch; past the first, the clip keeps updates near the behaviour policy
    micro_batch_tokens: int = 16384


@dataclass
class Sequence:
    tokens: list[int]
    completion_start: int  # index in ``tokens`` of the first trained token
    old_logprobs: list[float]
    advantage: float


@dataclass
class Batch:
    sequences: list[Sequence]
    rewards: list[float]
    groups: int
    skipped_groups: int
    trajectories: int

    @property
    def trained_tokens(self) -> int:
        return sum(len(s.old_logprobs) for s in self.sequences)


@dataclass
class StepStats:
    loss: float
    mean_reward: float
    sequences: int
    trained_tokens: int
    grad_norm: float
    seconds: float
    extra: dict[str, float] = field(default_factory=dict)


def build_batch(groups: list[list[Trajectory]], keep_flat: bool = False) -> Batch:
    """Turn groups of trajectories into trainable sequences with GRPO advantages.

    A group whose rewards are all equal has no policy-gradient signal and is counted as
    skipped; with ``keep_flat`` its sequences still come along (advantage 0) so that an entropy
    bonus can keep a prompt that the policy has collapsed on from staying collapsed.
    """
    sequences: list[Sequence] = []
    rewards: list[float] = []
    skipped = 0
    count = 0
    for group in groups:
        complete = [t for t in group if t.status == "complete" and t.turns]
        count += len(group)
        rewards.extend(t.reward for t in complete)
        if len(complete) < 2:
            skipped += 1
            continue
        advantages = group_advantages(torch.tensor([t.reward for t in complete], dtype=torch.float64))
        if float(advantages.abs().max()) == 0.0:
            skipped += 1
            if not keep_flat:
                continue
        for trajectory, advantage in zip(complete, advantages.tolist(), strict=True):
            for turn in trajectory.turns:
                sequences.append(
                    Sequence(
                        tokens=list(turn.prompt_token_ids) + list(turn.completion_token_ids),
                        completion_start=len(turn.prompt_token_ids),
                        old_logprobs=list(turn.completion_logprobs),
                        advantage=advantage,
                    )
                )
    return Batch(sequences, rewards, len(groups), skipped, count)


def _micro_batches(sequences: list[Sequence], budget: int) -> list[list[Sequence]]:
    ordered = sorted(sequences, key=lambda s: len(s.tokens))
    out: list[list[Sequence]] = [[]]
    for seq in ordered:
        width = max([len(seq.tokens)] + [len(s.tokens) for s in out[-1]])
        if out[-1] and width * (len(out[-1]) + 1) > budget:
            out.append([])
        out[-1].append(seq)
    return [mb for mb in out if mb]


def _collate(sequences: list[Sequence], pad_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    width = max(len(s.tokens) for s in sequences)
    n = len(sequences)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    loss_mask = torch.zeros((n, width - 1))
    old = torch.zeros((n, width - 1))
    adv = torch.zeros((n, width - 1))
    for i, seq in enumerate(sequences):
        length = len(seq.tokens)
        ids[i, :length] = torch.tensor(seq.tokens)
        attention[i, :length] = 1
        # logits at position p predict token p + 1: completion token j sits at start + j
        lo, hi = seq.completion_start - 1, length - 1
        loss_mask[i, lo:hi] = 1.0
        old[i, lo:hi] = torch.tensor(seq.old_logprobs)
        adv[i, lo:hi] = seq.advantage
    return {
        "input_ids": ids.to(device),
        "attention_mask": attention.to(device),
        "targets": ids[:, 1:].to(device),
        "loss_mask": loss_mask.to(device),
        "old_logprobs": old.to(device),
        "advantages": adv.to(device),
    }


class PolicyLogits(torch.nn.Module):
    """Wraps a causal LM: logits ``[T, V]`` at the T trained positions only.

    The output head runs only where tokens are trained: prompts, tool results and padding make
    up most of a sequence and need no logits, so the head (vocab x hidden, the largest matrix of
    a small model) costs in proportion to sampled tokens, not to context. Being one module with
    one ``forward`` also makes it the FSDP root, so a sharded model's embeddings, final norm and
    head are gathered around exactly this computation.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.lm = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, trained: torch.Tensor) -> torch.Tensor:
        model: Any = self.lm
        decoder: Any = getattr(model, "get_decoder", lambda: None)()
        head: Any = getattr(model, "get_output_embeddings", lambda: None)()
        if decoder is None or head is None:  # not a standard HF causal LM: full logits
            logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
            return logits[:, :-1, :][trained]  # type: ignore[no-any-return]
        hidden = decoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return head(hidden[:, :-1, :][trained])  # type: ignore[no-any-return]


class Learner:
    """Holds the trainable model and its optimizer; ``step`` is one policy update.

    With a ``DistContext`` of several ranks (see ``learner.distributed``) the model is sharded
    with FSDP2 and every rank must call ``step`` and ``full_state_dict`` on the same batches.
    """

    def __init__(
        self, model: torch.nn.Module, config: LearnerConfig, pad_id: int, ctx: DistContext | None = None
    ) -> None:
        self.model = model
        self.config = config
        self.pad_id = pad_id
        self.ctx = ctx or DistContext(device=str(next(model.parameters()).device))
        self.device = next(model.parameters()).device
        self.policy = PolicyLogits(model)
        shard_model(self.policy, decoder_layers(model), self.ctx)
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=config.lr, weight_decay=config.weight_decay)
        self.steps = 0

    def sequence_logprobs(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Target log-probabilities and policy entropies, each ``[N, L-1]``, 0 off trained positions."""
        trained = batch["loss_mask"].bool()
        logits = self.policy(batch["input_ids"], batch["attention_mask"], trained)
        logp = torch.log_softmax(logits.float(), dim=-1)
        values = logp.gather(-1, batch["targets"][trained].unsqueeze(-1)).squeeze(-1)
        entropy = -(logp.exp() * logp).sum(-1)
        zeros = torch.zeros(trained.shape, dtype=values.dtype, device=values.device)
        return zeros.masked_scatter(trained, values), zeros.masked_scatter(trained, entropy)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's weights on CPU (gathered from every rank; empty on ranks other than 0)."""
        return full_state_dict(self.model, self.ctx)

    def training_state(self) -> dict[str, Any]:
        """Everything a resumed learner needs, whole, on rank 0 (collective under FSDP; ``{}``
        elsewhere): model weights (HF names), optimizer state (by parameter name, so it loads into
        any world size), step count and RNG state."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        optimizer = get_optimizer_state_dict(self.policy, self.optimizer, options=options)
        weights = self.full_state_dict()
        if not self.ctx.is_main:
            return {}
        return {
            "weights": weights,
            "optimizer": optimizer,
            "steps": self.steps,
            "rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
        }

    def load_training_state(self, state: dict[str, Any] | None) -> None:
        """Inverse of ``training_state``: rank 0 passes the state, the others ``None`` (collective)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=self.ctx.enabled)
        weights: dict[str, Any] = (
            {f"lm.{k}": v for k, v in self._complete_tied(state["weights"]).items()} if state else {}
        )
        set_model_state_dict(self.policy, weights, options=options)
        set_optimizer_state_dict(self.policy, self.optimizer, state["optimizer"] if state else {}, options=options)
        steps = state["steps"] if state else 0
        if self.ctx.enabled:
            import torch.distributed as dist

            box = [steps]
            dist.broadcast_object_list(box, src=0)
            steps = box[0]
        self.steps = int(steps)
        if state:
            torch.set_rng_state(state["rng"])
            random.setstate(state["python_rng"])

    def _complete_tied(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Fill names that a saved HF checkpoint leaves out because they share a tensor with another
        (a tied output head); any other missing name is an error."""
        groups: dict[int, list[str]] = {}
        for name, param in self.model.named_parameters(remove_duplicate=False):
            groups.setdefault(id(param), []).append(name)
        out = dict(weights)
        missing = []
        for names in groups.values():
            present = [n for n in names if n in weights]
            for name in names:
                if name not in out:
                    if present:
                        out[name] = weights[present[0]]
                    else:
                        missing.append(name)
        if missing:
            raise ValueError(f"the checkpoint has no weights for {', '.join(sorted(missing)[:5])}")
        return out

    def _plan(self, sequences: list[Sequence]) -> list[dict[str, torch.Tensor] | None]:
        """This rank's micro-batches, padded with ``None`` to the largest count of any rank:
        FSDP gathers weights collectively, so every rank runs the same number of passes."""
        budget = self.config.micro_batch_tokens
        shares = partition(sequences, self.ctx.world_size) if self.ctx.enabled else [sequences]
        counts = [len(_micro_batches(share, budget)) for share in shares]
        mine = _micro_batches(shares[self.ctx.rank], budget)
        tensors: list[dict[str, torch.Tensor] | None] = [_collate(part, self.pad_id, self.device) for part in mine]
        return tensors + [None] * (max(counts) - len(mine))

    def _idle_pass(self) -> dict[str, torch.Tensor]:
        """A one-token stand-in micro-batch for a rank with no sequences left; its loss is scaled by 0."""
        return _collate([Sequence([self.pad_id, self.pad_id], 1, [0.0], 0.0)], self.pad_id, self.device)

    def step(self, batch: Batch) -> StepStats:
        if not batch.sequences:
            raise ValueError("the batch has no trainable sequence (every group had equal rewards)")
        started = time.perf_counter()
        self.policy.train()
        total = float(batch.trained_tokens)
        plan = self._plan(batch.sequences)
        loss_sum, grad_norm = 0.0, 0.0
        extra: dict[str, float] = {}
        for _epoch in range(self.config.epochs):
            self.optimizer.zero_grad(set_to_none=True)
            loss_sum = 0.0
            extra = {}
            for planned in plan:
                part = planned if planned is not None else self._idle_pass()
                logprobs, entropy = self.sequence_logprobs(part)
                loss, stats = clipped_policy_loss(
                    logprobs,
                    part["old_logprobs"],
                    part["advantages"],
                    part["loss_mask"],
                    self.config.clip_low,
                    self.config.clip_high,
                    normaliser=total,
                )
                if self.config.entropy_coef:
                    loss = loss - self.config.entropy_coef * (entropy * part["loss_mask"]).sum() / total
                    with torch.no_grad():
                        stats["entropy"] = float(
                            (entropy * part["loss_mask"]).sum() / part["loss_mask"].sum().clamp(min=1)
                        )
                weight = float(part["loss_mask"].sum()) / total
                if planned is None:
                    loss, weight = loss * 0.0, 0.0
                # FSDP averages gradients over ranks; each rank's loss is its share of the batch's sum
                (loss * self.ctx.world_size).backward()  # type: ignore[no-untyped-call]
                loss_sum += float(loss.detach())
                for key, value in stats.items():
                    extra[key] = extra.get(key, 0.0) + value * weight
            norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.config.max_grad_norm)
            grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
            self.optimizer.step()
        loss_sum, extra = self._sum_over_ranks(loss_sum, extra)
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
        )

    def _sum_over_ranks(self, loss: float, extra: dict[str, float]) -> tuple[float, dict[str, float]]:
        if not self.ctx.enabled:
            return loss, extra
        import torch.distributed as dist

        keys = sorted(extra)
        values = torch.tensor([loss] + [extra[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(values)
        return float(values[0]), dict(zip(keys, values[1:].tolist(), strict=True))
