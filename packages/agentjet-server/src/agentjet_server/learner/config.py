"""The learner's settings (``LearnerConfig``): the objective, its coefficients, the batch's split into mini- and
micro-batches, precision and memory. The server makes one from its settings (``control.learner_config``) and
changes it between steps (``Learner.reconfigure``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from agentjet_server.engine.adapter import LoraSpec

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
    # the group estimator of a batch's advantages (learner.advantages), or gae (PPO's critic: learner.prepare)
    advantage: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "passk", "gae"] = "grpo"
    mask_truncated: bool = False  # DAPO's overlong filtering: an episode cut off at its token limit trains nothing
    # DAPO's overlong reward shaping: a turn within this many tokens of its limit costs up to overlong_penalty
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    off_policy: OffPolicy = "decoupled"
    is_cap: float = 2.0  # truncation of the behaviour importance weight (decoupled, tis)
    # the policy loss (learner.objective.policy_terms): ppo, gspo, cispo, sapo, importance_sampling, dro
    policy_loss: Literal["ppo", "gspo", "cispo", "sapo", "importance_sampling", "dro"] = "ppo"
    cispo_cap: float = 5.0  # cispo: the cap of its stop-gradient importance weight
    sapo_tau_pos: float = 1.0  # sapo: the gate's temperature where the advantage is positive
    sapo_tau_neg: float = 1.05  # sapo: and elsewhere
    dro_beta: float = 0.05  # dro: the weight of the quadratic penalty on log(pi / pi_old)
    # how token losses become the step's (learner.objective.aggregate)
    loss_aggregation: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = (
        "token-mean"
    )
    loss_norm_length: int = 1024  # seq-mean-token-sum-norm: a sequence's token sum is divided by this
    # rollout correction against the sampler's log-probs mu (docs/objectives.md): with any of these, pi_old is the
    # trainer's own log-prob of every token at the weights about to be updated (never the sampled one reused)
    token_mask: tuple[float, float] | None = None  # IcePop: a token whose pi_old / mu is outside trains nothing
    sequence_mask: tuple[float, float] | None = None  # a sequence whose geometric-mean pi_old / mu is outside: nothing
    sequence_is: bool = False  # decoupled's truncated weight per sequence (min(prod pi_old / mu, is_cap))
    mismatch_kl_coef: float = 0.0  # a penalty coef * (log pi - log mu)^2 / 2 per trained token
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
