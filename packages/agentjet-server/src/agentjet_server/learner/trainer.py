"""One GRPO step over a batch of trajectory groups, top to bottom.

1. ``build_batch`` — for each group, normalise rewards among its complete episodes
   (``group_advantages``); skip groups with no signal (all rewards equal). Each remaining
   episode's turns are merged into timelines (``batching.timeline``: a turn that extends an
   earlier one token for token continues it), and each timeline becomes one sequence whose
   sampled tokens are trained, each with its behaviour log-probability and the episode's advantage.
2. ``Learner.step`` — pack the sequences into prefix trees (``learner.packing``: shared prefixes
   such as a group's prompt are computed once), forward each micro-batch with a tree attention
   mask, compute ``clipped_policy_loss`` over the trained tokens normalised by the batch's total,
   accumulate gradients, clip the gradient norm, one AdamW step.

The server runs this in a background thread (``learner.loop``); it runs on its own, too:

    learner = Learner(model, LearnerConfig(lr=1e-3), pad_id=0)
    stats = learner.step(build_batch(groups))
"""

from __future__ import annotations

import inspect
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from agentjet_client.protocol import Trajectory
from agentjet_server.batching.timeline import build_timelines, call_tokens
from agentjet_server.learner.distributed import (
    DistContext,
    decoder_layers,
    full_state_dict,
    partition,
    shard_model,
)
from agentjet_server.learner.losses import clipped_policy_loss, group_advantages
from agentjet_server.learner.packing import Packed, Sequence, pack


@dataclass(frozen=True)
class LearnerConfig:
    lr: float = 1e-3
    weight_decay: float = 0.0
    clip_low: float = 0.2
    clip_high: float = 0.28
    max_grad_norm: float = 1.0
    entropy_coef: float = 0.0  # bonus on the policy's entropy at trained positions
    epochs: int = 1  # optimizer steps per batch; past the first, the clip keeps updates near the behaviour policy
    micro_batch_tokens: int = 8192  # prefix-tree nodes per micro-batch
    tree_attention: str = "auto"  # dense | segments | auto (see learner.packing)


@dataclass
class Batch:
    sequences: list[Sequence]
    rewards: list[float]
    groups: int
    skipped_groups: int
    trajectories: int

    call_tokens: int = 0  # what training one sample per call would process
    included: list[Trajectory] = field(default_factory=list)  # episodes whose sampled tokens are all trained

    @property
    def trained_tokens(self) -> int:
        return sum(s.trained_tokens for s in self.sequences)


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


def build_batch(groups: list[list[Trajectory]], keep_flat: bool = False) -> Batch:
    """Turn groups of trajectories into trainable sequences with GRPO advantages.

    Rewards are normalised within each group of siblings: the episode's reward for every timeline,
    or, in a multi-agent episode with ``agent_rewards``, each agent's own reward for that agent's
    timelines (normalised among the same agent of the siblings). A group whose rewards are all
    equal has no policy-gradient signal and is counted as skipped; with ``keep_flat`` its
    sequences still come along (advantage 0) so that an entropy bonus can keep a prompt that the
    policy has collapsed on from staying collapsed.
    """
    sequences: list[Sequence] = []
    rewards: list[float] = []
    skipped = 0
    count = 0
    call_count = 0
    included: list[Trajectory] = []
    for group in groups:
        complete = [t for t in group if t.status == "complete" and t.turns]
        count += len(group)
        rewards.extend(t.reward for t in complete)
        if len(complete) < 2:
            skipped += 1
            continue
        advantages = _group_advantages(complete)
        if all(a == 0.0 for per_agent in advantages for a in per_agent.values()):
            skipped += 1
            if not keep_flat:
                continue
        for trajectory, per_agent in zip(complete, advantages, strict=True):
            call_count += call_tokens(trajectory.turns)
            included.append(trajectory)
            for timeline in build_timelines(trajectory.turns):
                advantage = per_agent.get(timeline.agent, per_agent[""])
                sequences.append(
                    Sequence(
                        tokens=timeline.tokens,
                        positions=timeline.trained,
                        old_logprobs=timeline.old_logprobs,
                        advantages=[advantage] * len(timeline.trained),
                    )
                )
    return Batch(sequences, rewards, len(groups), skipped, count, call_count, included)


def _group_advantages(complete: list[Trajectory]) -> list[dict[str, float]]:
    """Per trajectory: ``{"": episode advantage, agent: that agent's advantage, ...}``."""

    def normalised(values: list[float]) -> list[float]:
        return group_advantages(torch.tensor(values, dtype=torch.float64)).tolist()

    out: list[dict[str, float]] = [{"": a} for a in normalised([t.reward for t in complete])]
    agents = sorted({name for t in complete for name in (t.agent_rewards or {})})
    for name in agents:
        values = [(t.agent_rewards or {}).get(name, t.reward) for t in complete]
        for per_agent, advantage in zip(out, normalised(values), strict=True):
            per_agent[name] = advantage
    return out


def _cache_kwarg(module: Any) -> str:
    """transformers renamed ``past_key_values`` to ``cache``; speak whichever this version knows."""
    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


class PolicyLogits(torch.nn.Module):
    """Wraps a causal LM: logits ``[E, V]`` at the E nodes whose next token is trained.

    Runs on a packed micro-batch (one row, ``position_ids`` and an optional tree mask, see
    ``learner.packing``). The output head runs only at trained entries: prompts, tool results and
    shared prefixes make up most of a batch and need no logits, so the head (vocab x hidden, the
    largest matrix of a small model) costs in proportion to sampled tokens, not to context. Being
    one module with one ``forward`` also makes it the FSDP root, so a sharded model's embeddings,
    final norm and head are gathered around exactly this computation.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.lm = model

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        nodes: torch.Tensor,
        segments: list[tuple[int, int, int]] | None = None,
    ) -> torch.Tensor:
        model: Any = self.lm
        decoder: Any = getattr(model, "get_decoder", lambda: None)()
        head: Any = getattr(model, "get_output_embeddings", lambda: None)()
        if segments is not None and decoder is not None and head is not None:
            return head(self._segment_hidden(decoder, input_ids, position_ids, segments)[nodes])  # type: ignore[no-any-return]
        if segments is not None:
            raise ValueError("segment-wise tree attention needs a Hugging Face causal LM (get_decoder)")
        inputs = {"input_ids": input_ids, "position_ids": position_ids, "attention_mask": attention_mask}
        if decoder is None or head is None:  # not a standard HF causal LM: full logits
            return model(**inputs).logits[0, nodes]  # type: ignore[no-any-return]
        hidden = decoder(**inputs).last_hidden_state
        return head(hidden[0, nodes])  # type: ignore[no-any-return]

    def _segment_hidden(
        self, decoder: Any, input_ids: torch.Tensor, position_ids: torch.Tensor, segments: list[tuple[int, int, int]]
    ) -> torch.Tensor:
        """Hidden states ``[N, H]`` of a tree run chain by chain, each continuing from its
        ancestors' keys and values (kept in the graph: the prefix gets every branch's gradient)."""
        from transformers import DynamicCache

        config = getattr(self.lm, "config", None)
        cache_kwarg = _cache_kwarg(decoder)
        kv: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        hidden = []
        for start, end, parent in segments:
            chain = []
            while parent >= 0:
                chain.append(parent)
                parent = segments[parent][2]
            cache: Any = DynamicCache(config=config)
            if chain:
                chain.reverse()
                for layer in range(len(kv[chain[0]])):
                    keys = torch.cat([kv[s][layer][0] for s in chain], dim=2)
                    values = torch.cat([kv[s][layer][1] for s in chain], dim=2)
                    cache.update(keys, values, layer)
            out = decoder(
                input_ids=input_ids[:, start:end],
                position_ids=position_ids[:, start:end],
                use_cache=True,
                **{cache_kwarg: cache},
            )
            n = end - start
            kv.append([(layer.keys[:, :, -n:], layer.values[:, :, -n:]) for layer in cache.layers])
            hidden.append(out.last_hidden_state[0])
        return torch.cat(hidden)


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

    def reconfigure(self, config: LearnerConfig) -> None:
        """Take new settings between steps: the learning rate goes to the optimizer at once."""
        for group in self.optimizer.param_groups:
            group["lr"] = config.lr
            group["weight_decay"] = config.weight_decay
        self.config = config

    def sequence_logprobs(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probability of each trained entry's token, and the policy's entropy there, ``[E]``."""
        logits = self.policy(
            batch["input_ids"], batch["position_ids"], batch["attention_mask"], batch["entry_nodes"], batch["segments"]
        )
        logp = torch.log_softmax(logits.float(), dim=-1)
        values = logp.gather(-1, batch["targets"].unsqueeze(-1)).squeeze(-1)
        entropy = -(logp.exp() * logp).sum(-1)
        return values, entropy

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

    def _plan(self, sequences: list[Sequence]) -> tuple[list[dict[str, Any] | None], int]:
        """This rank's packed micro-batches, padded with ``None`` to the largest count of any
        rank (FSDP gathers weights collectively, so every rank runs the same number of passes),
        and the tokens all ranks process."""
        packed = pack(sequences, self.config.micro_batch_tokens)
        shares = partition(packed, self.ctx.world_size, lambda p: p.size) if self.ctx.enabled else [packed]
        mine = shares[self.ctx.rank]
        # segment-wise trees run a varying number of decoder passes per micro-batch; FSDP gathers
        # each layer once per pass, collectively, so sharded ranks must all use one pass (dense)
        mode = "dense" if self.ctx.enabled else self.config.tree_attention
        tensors: list[dict[str, Any] | None] = [p.tensors(self.device, mode) for p in mine]
        return tensors + [None] * (max(len(s) for s in shares) - len(mine)), sum(p.size for p in packed)

    def _idle_pass(self) -> dict[str, Any]:
        """A one-token stand-in micro-batch for a rank with no sequences left; its loss is scaled by 0."""
        stand_in = Packed()
        stand_in.insert(Sequence([self.pad_id, self.pad_id], [1], [0.0], [0.0]))
        return stand_in.tensors(self.device)

    def step(self, batch: Batch) -> StepStats:
        if not batch.sequences:
            raise ValueError("the batch has no trainable sequence (every group had equal rewards)")
        started = time.perf_counter()
        self.policy.train()
        total = float(batch.trained_tokens)
        plan, processed = self._plan(batch.sequences)
        loss_sum, grad_norm = 0.0, 0.0
        extra: dict[str, float] = {}
        for _epoch in range(self.config.epochs):
            self.optimizer.zero_grad(set_to_none=True)
            loss_sum = 0.0
            extra = {}
            for planned in plan:
                part = planned if planned is not None else self._idle_pass()
                logprobs, entropy = self.sequence_logprobs(part)
                mask = torch.ones_like(logprobs)
                loss, stats = clipped_policy_loss(
                    logprobs,
                    part["old_logprobs"],
                    part["advantages"],
                    mask,
                    self.config.clip_low,
                    self.config.clip_high,
                    normaliser=total,
                )
                if self.config.entropy_coef:
                    loss = loss - self.config.entropy_coef * entropy.sum() / total
                with torch.no_grad():
                    stats["entropy"] = float(entropy.mean())
                weight = float(logprobs.numel()) / total
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
            processed_tokens=processed,
            micro_batches=len(plan),
        )

    def _sum_over_ranks(self, loss: float, extra: dict[str, float]) -> tuple[float, dict[str, float]]:
        if not self.ctx.enabled:
            return loss, extra
        import torch.distributed as dist

        keys = sorted(extra)
        values = torch.tensor([loss] + [extra[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(values)
        return float(values[0]), dict(zip(keys, values[1:].tolist(), strict=True))
