"""The server's settings in their groups, one field per option of ``agentjet-server up``: each field's default,
its help text, its bounds, and whether a running server takes a change of it (``live``). ``settings.ServerSettings``
joins the groups and checks the rules across them."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

TEACHER_KEY_ENV = "AGENTJET_TEACHER_API_KEY"  # the key a --teacher URL takes, if it asks for one


def setting(default: Any, description: str, *, live: str | None = None, flag: str | None = None, **bounds: Any) -> Any:
    """A setting's field: its default, its ``up --help`` text, and optionally what changing it on a running
    server does (``live``: it is then an admin API live setting) and a flag name other than its own."""
    extra: dict[str, Any] = {key: value for key, value in (("live", live), ("flag", flag)) if value is not None}
    return Field(default=default, description=description, json_schema_extra=extra or None, **bounds)


class OptionGroup(BaseModel):
    """A group of settings, listed under its own ``panel`` in ``agentjet-server up --help``."""

    panel: ClassVar[str]
    model_config = ConfigDict(extra="forbid")


class ServingOptions(OptionGroup):
    """The HTTP server: where it listens and how long it waits for a slow peer."""

    panel: ClassVar[str] = "Serving"

    host: str = setting("127.0.0.1", "interface to listen on")
    port: int = setting(8000, "port to listen on", ge=0, le=65535)
    max_connections: int | None = setting(
        None, "connections held at once (default: what the open-file limit allows)", ge=1
    )
    header_timeout_s: float = setting(
        10.0, "seconds a connection may take to send request headers", flag="header-timeout", gt=0
    )
    body_timeout_s: float = setting(30.0, "seconds a request body may take to arrive", flag="body-timeout", gt=0)
    write_timeout_s: float = setting(
        60.0, "seconds a client may leave a streamed answer unread before it is dropped", flag="write-timeout", gt=0
    )
    serve_only: bool = setting(
        False,
        "serve the model and never learn: no learner copy is built, pushed trajectories are "
        "refused (a frozen judge or reference model)",
    )


class LimitOptions(OptionGroup):
    """What one request may ask of the server."""

    panel: ClassVar[str] = "Limits"

    max_body_bytes: int = setting(16 * 1024 * 1024, "largest trajectory batch a push may send, in bytes", ge=1024)
    max_chat_body_bytes: int = setting(4 * 1024 * 1024, "largest inference request body, in bytes", ge=1024)
    max_request_token_entries: int = setting(
        1 << 20, "n x max_tokens x (1 + top_logprobs) one request may ask for", ge=1024
    )
    default_max_tokens: int = setting(
        512,
        "completion tokens of a request that sets no max_tokens",
        live="the completion limit of requests that set none",
        ge=1,
    )
    tinker_full_clients: int = setting(
        1,
        "full-model training clients the Tinker API holds at once, each a trainable fp32 copy of the model with "
        "its own AdamW (about 16 bytes a parameter); 0: LoRA clients only",
        ge=0,
        le=8,
    )
    exact_sampling: bool = setting(
        False,
        "refuse the sampling settings that change the model's distribution (logit_bias, presence/frequency "
        "and repetition penalties, top_k, min_p, min_tokens, ignore_eos): every trained token then comes from "
        "the policy itself, not a processed distribution corrected for",
    )


class SecurityOptions(OptionGroup):
    """Who may call the server, and which turns it trains."""

    panel: ClassVar[str] = "Security"

    api_keys: list[str] = Field(
        default_factory=list,
        description="accepted client keys (from --api-key, --api-key-file and AGENTJET_API_KEYS)",
        json_schema_extra={"flag": None},
    )
    admin_keys: list[str] = Field(
        default_factory=list,
        description="accepted admin keys (from --admin-key, --admin-key-file and AGENTJET_ADMIN_KEYS)",
        json_schema_extra={"flag": None},
    )
    require_signed: bool | None = setting(
        None, "train only turns this server signed (default: on whenever keys are set)"
    )
    insecure: bool = setting(False, "serve a non-loopback --host without any API key")


class EngineOptions(OptionGroup):
    """The model and the engine that serves it."""

    panel: ClassVar[str] = "Model and engine"

    model: Path | None = setting(None, "local Hugging Face model dir (default: embedded tiny model)")
    model_name: str | None = setting(None, "name served in /v1/models")
    model_size: Literal["tiny", "small", "tools"] = setting(
        "tiny",
        "embedded model when no --model is given: tiny (0.66M parameters), small (1.7M), or tools (0.69M;"
        " calls the tools a request lists); all three ship prebuilt",
    )
    device: str = setting("cpu", "torch device for engine and learner")
    engine: Literal["transformers", "vllm"] = setting("transformers", "inference engine: transformers or vllm")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = setting(
        "auto", "engine weights: auto (fp32 CPU, bf16 GPU), float32, bfloat16"
    )
    engine_devices: str | None = setting(
        None, "the engine's device, e.g. cuda:1, or one per replica: cuda:0,cuda:1 (default: --device)"
    )
    engine_replicas: int = setting(
        1,
        "engine processes serving the model (each on its own device; on CPU each with its share of the "
        "cores); requests go to the least-loaded, an episode's calls to the one holding its prefix",
        ge=1,
    )
    remote_replica_ranks: str | None = setting(
        None,
        "under torchrun, ranks on other machines that each host an engine replica too (e.g. 8,16): "
        "weights reach them by broadcast, requests over TCP",
    )
    tensor_parallel_size: int = setting(1, "vLLM: devices per engine replica, for models that need several", ge=1)
    gpu_memory_utilization: float | None = setting(
        None, "vLLM's share of its GPU (default: what the learner's memory plan leaves on a shared GPU)", gt=0, le=1
    )
    engine_sleep: bool = setting(
        False,
        "vLLM's sleep mode: during each learner step the engine frees its KV cache and moves its weights "
        "to host memory; serving pauses until the new weights are in (with --engine-replicas: the "
        "replicas on a learner's device sleep, the others serve on)",
    )
    max_batch: int = setting(64, "requests the transformers engine decodes together", ge=1)
    tool_call_parser: str | None = setting(
        None, "tool-call format of the model family: vLLM's names (hermes, llama3_json, mistral, ...)"
    )
    reasoning_parser: str | None = setting(
        None, "reasoning format of the model family: vLLM's names (qwen3, deepseek_r1, ...)"
    )
    chat_template: Path | None = setting(None, "Jinja chat template file used instead of the model's own")


class BatchOptions(OptionGroup):
    """How pushed trajectories become batches: groups, staleness, admission, the task mix."""

    panel: ClassVar[str] = "Batches"

    batch_groups: int = setting(
        10, "complete GRPO groups per policy update", live="GRPO groups per step, from the next batch", ge=1
    )
    group_size: int = setting(
        16, "episodes per task in a GRPO group", live="episodes per GRPO group, for groups that are still open", ge=2
    )
    max_staleness: int = setting(
        4,
        "reject trajectories more than this many versions old",
        live="the staleness bound, for trajectories pushed from now on and batches built from now on",
        ge=0,
    )
    stale_policy: Literal["drop", "downweight"] = setting(
        "drop",
        "an episode past --max-staleness by the time it is trained: drop or downweight",
        live="what happens to an episode past the bound when its batch is built, from the next batch",
    )
    mix: dict[str, float] = Field(
        default_factory=dict,
        description="task mix: TAG=WEIGHT,... admits (and so trains) episodes of each tag in these proportions",
        json_schema_extra={
            "live": "the task mix (tag -> weight) admission keeps trained episodes in, from the next status poll"
        },
    )
    admission_batches: int = setting(
        2,
        "batches' worth of episodes clients may run ahead of the learner, at least: more while the learner "
        "waits for complete groups and the trained tokens' lag has room under --max-staleness",
        live="the least batches' worth of episodes runners are invited to start",
        ge=1,
    )
    max_buffered: int | None = setting(
        None, "trajectories held for training before pushes get 429 (default: 4 batches' worth)", ge=1
    )
    max_buffer_bytes: int = setting(
        2 << 30, "approximate memory the training buffer may hold before pushes get 429", ge=1 << 20
    )
    group_timeout_s: float = setting(
        600.0,
        "seconds after which an incomplete GRPO group is trained as a smaller one",
        flag="group-timeout",
        live="when an incomplete group is trained as a smaller one",
        gt=0,
    )


class LearnerOptions(OptionGroup):
    """The learner: where and in what precision it runs, and the objective it optimises."""

    panel: ClassVar[str] = "Training"

    algorithm: Literal["grpo", "ppo"] = setting(
        "grpo", "grpo (group-normalised rewards) or ppo (a critic on the policy, GAE)"
    )
    advantage: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "passk", "gae"] | None = setting(
        None,
        "the advantage estimator (docs/objectives.md): grpo, dr_grpo, rloo, reinforce_pp or passk with --algorithm "
        "grpo; gae (the critic's) with ppo (default: grpo, or gae with ppo)",
        live="the advantage estimator, from the next batch",
    )
    mask_truncated: bool = setting(
        False,
        "overlong filtering (DAPO): an episode with a turn cut off at its token limit (finish_reason length) "
        "counts in its group's baseline and trains no token",
        live="overlong filtering, from the next batch",
    )
    overlong_buffer: int = setting(
        0,
        "overlong reward shaping (DAPO): a turn whose completion comes within this many tokens of its limit "
        "(max_tokens) lowers the episode's reward, linearly to --overlong-penalty at the limit (0 = off)",
        live="overlong reward shaping, from the next batch",
        ge=0,
    )
    overlong_penalty: float = setting(
        1.0,
        "overlong reward shaping: the reward an episode loses for a turn that reached its token limit",
        live="the overlong penalty, from the next batch",
        ge=0,
    )
    lr: float = setting(0.001, "AdamW learning rate", live="the learner's learning rate, from the next step", gt=0)
    clip_low: float = setting(
        0.2,
        "policy ratio clip: its lower bound is 1 - clip-low",
        live="the lower clip of the policy ratio, from the next step",
        ge=0,
    )
    clip_high: float = setting(
        0.28,
        "policy ratio clip: its upper bound is 1 + clip-high (DAPO's clip-higher)",
        live="the upper clip of the policy ratio, from the next step",
        ge=0,
    )
    max_grad_norm: float = setting(
        1.0, "gradient norm clip of each optimizer step", live="gradient clipping, from the next step", gt=0
    )
    entropy_coef: float = setting(
        0.0, "entropy bonus at trained tokens (0 = off)", live="the entropy bonus, from the next step", ge=0
    )
    off_policy: Literal["decoupled", "tis", "none"] = setting(
        "decoupled",
        "correction for stale turns: decoupled (AReaL), tis, or none (clip only)",
        live="the off-policy correction (decoupled, tis, none), from the next step",
    )
    is_cap: float = setting(
        2.0,
        "truncation of the importance weight (decoupled, tis)",
        live="the importance-weight cap, from the next step",
        ge=1.0,
    )
    policy_loss: Literal["ppo", "gspo", "cispo", "sapo", "importance_sampling", "dro"] = setting(
        "ppo",
        "the policy loss (docs/objectives.md): ppo (clipped ratio), gspo (one length-normalised ratio per "
        "sequence), cispo (capped stop-gradient weight), sapo (soft gate), importance_sampling, dro",
        live="the policy loss, from the next step",
    )
    cispo_cap: float = setting(
        5.0, "cispo: the cap of its importance weight", live="cispo's weight cap, from the next step", gt=1.0
    )
    sapo_tau_pos: float = setting(
        1.0, "sapo: the gate's temperature at positive advantages", live="sapo's temperatures, next step", gt=0
    )
    sapo_tau_neg: float = setting(
        1.05, "sapo: the gate's temperature elsewhere", live="sapo's temperatures, from the next step", gt=0
    )
    dro_beta: float = setting(
        0.05, "dro: the weight of its quadratic penalty on log(pi / pi_old)", live="dro's penalty, next step", ge=0
    )
    token_mask: tuple[float, float] | None = setting(
        None,
        "rollout correction (IcePop): a token whose pi_old / mu (trainer over sampler) is outside LOW,HIGH trains "
        "nothing (e.g. 0.5,5)",
        live="the token mask of rollout correction, from the next step",
    )
    sequence_mask: tuple[float, float] | None = setting(
        None,
        "rollout correction: a sequence whose geometric-mean pi_old / mu is outside LOW,HIGH trains nothing "
        "(e.g. 0.98,1.02)",
        live="the sequence mask of rollout correction, from the next step",
    )
    sequence_is: bool = setting(
        False,
        "rollout correction, with --off-policy decoupled: the truncated importance weight per sequence, "
        "min(prod pi_old / mu, --is-cap) on each of its tokens, in place of the weight per token",
        live="whether the importance weight is taken per sequence, from the next step",
    )
    mismatch_kl_coef: float = setting(
        0.0,
        "rollout correction: a penalty coef * (log pi - log mu)^2 / 2 per trained token, towards the sampler",
        live="the penalty towards the sampler's log-probs, from the next step",
        ge=0,
    )
    loss_aggregation: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = (
        setting(
            "token-mean",
            "how token losses become the step's: token-mean over the step, or per sequence (token sum, token "
            "mean, or token sum over --loss-norm-length) then the mean over sequences",
            live="the loss aggregation, from the next step",
        )
    )
    loss_norm_length: int = setting(
        1024,
        "seq-mean-token-sum-norm: the constant a sequence's token sum is divided by (Dr. GRPO: the longest answer)",
        live="the aggregation's length constant, from the next step",
        ge=1,
    )
    kl_coef: float = setting(
        0.0,
        "k3 KL penalty to the reference model (0 = off)",
        live="the KL penalty, from the next step (only on a server started with --kl-coef above 0)",
        ge=0,
    )
    reference: Path | None = setting(None, "reference model dir for --kl-coef (default: the initial weights)")
    teacher: str | None = setting(
        None,
        "on-policy distillation: a teacher (same tokenizer) scores the samples trained on: a model dir, or the "
        "URL of a server that scores prompts (/v1/completions echo + logprobs: AgentJet, vLLM); its key from "
        f"{TEACHER_KEY_ENV}",
    )
    teacher_model: str | None = setting(None, "the model to ask a --teacher URL for (default: its first listed)")
    distill_coef: float = setting(
        1.0,
        "weight of the teacher's per-token advantage (--teacher)",
        live="the weight of the teacher's advantage, from the next step (only with --teacher)",
        ge=0,
    )
    distill_loss: Literal["sampled", "full"] = setting(
        "sampled",
        "distillation: sampled = the teacher's advantage at each sampled token; full = the exact KL to the "
        "teacher over the vocabulary at each sampled position (a local --teacher DIR)",
    )
    mini_batches: int = setting(
        1,
        "optimizer steps per batch, each on its share",
        live="optimizer steps per batch, from the next step",
        ge=1,
        le=64,
    )
    gamma: float = setting(1.0, "PPO: discount per trained token", gt=0, le=1)
    lam: float = setting(0.95, "PPO: GAE lambda", flag="gae-lambda", ge=0, le=1)
    vf_coef: float = setting(0.5, "PPO: weight of the critic's loss", ge=0)
    advantage_norm: Literal["group", "batch"] = setting(
        "group", "PPO: whiten advantages per group of sibling episodes (group) or over the batch"
    )
    seed: int = setting(0, "random seed of the learner")
    learner_devices: str | None = setting(
        None, "the learner's device; under torchrun one per local rank, comma-separated (default: --device)"
    )
    learner_dtype: Literal["float32", "bfloat16"] = setting(
        "float32", "learner compute precision: float32, or bfloat16 (autocast; fp32 master weights)"
    )
    optimizer_dtype: Literal["float32", "bfloat16"] = setting(
        "float32", "weights, gradients and AdamW state: float32, or bfloat16 (half the memory)"
    )
    gradient_checkpointing: bool = setting(
        False, "keep only each layer's input and recompute the rest in the backward pass"
    )
    cpu_offload: bool = setting(
        False,
        "FSDP2 CPU offload: the learner's weights, gradients and AdamW state in host memory, the "
        "optimizer step on the CPU (slower steps, a fraction of the GPU memory)",
    )
    lora_rank: int = setting(0, "train a LoRA adapter of this rank on the frozen model (0: train every weight)", ge=0)
    lora_alpha: float | None = setting(
        None, "LoRA: the adapter's scale is alpha / rank (default alpha: 2 x rank)", gt=0
    )
    lora_dropout: float = setting(0.0, "LoRA: dropout on the adapter's input", ge=0, lt=1)
    lora_targets: str = setting(
        "all-linear", "LoRA: layers that get adapters: all-linear, or module names (q_proj,v_proj)"
    )
    adapters: str | None = setting(
        None,
        "an adapter per agent on one frozen base (with --lora-rank): names, e.g. planner,executor; a call is "
        "sampled with the adapter its model or agent names, and each adapter trains on its own turns alone",
    )
    micro_batch_tokens: int = setting(8192, "tokens per learner micro-batch (activation memory grows with it)", ge=64)
    memory_budget_gb: float | None = setting(
        None, "plan for this many GiB per device instead of the device's total memory", gt=0
    )
    memory_check: bool = setting(
        True, "refuse to start when the memory plan does not fit (--no-memory-check: start anyway)"
    )


class StateOptions(OptionGroup):
    """The run's state on disk and what it reports: checkpoints, metrics, inspectable trajectories."""

    panel: ClassVar[str] = "State and metrics"

    state_dir: Path = setting(Path(".agentjet/server"), "trajectory log and checkpoints; one server per directory")
    resume: bool = setting(False, "continue the run in --state-dir from its newest checkpoint, replaying the log")
    fresh: bool = setting(False, "discard an earlier run in --state-dir and start over")
    checkpoint_every: int = setting(
        20, "learner steps between checkpoints (0 = on shutdown only)", live="steps between checkpoints", ge=0
    )
    keep_checkpoints: int = setting(2, "checkpoints kept in --state-dir (older ones are deleted)", ge=1)
    metrics: bool = setting(
        True,
        "serve /metrics and the dashboard's history, and write metrics.jsonl in --state-dir"
        " (--no-metrics: none of these)",
    )
    metrics_interval_s: float = setting(
        60.0, "seconds between metrics history lines while idle", flag="metrics-interval", gt=0
    )
    log_to: list[Literal["tensorboard", "wandb"]] = Field(
        default_factory=list,
        description="also log metrics to tensorboard or wandb (offline; repeatable; needs the package)",
    )
    keep_recent_trajectories: int = setting(
        200, "trajectory bodies kept inspectable (dashboard, inspect) after the log compacts", ge=0
    )
    checkpoint_uri: str | None = setting(
        None, "mirror the run to an object store (s3://bucket/prefix): --resume restores from it"
    )
    checkpoint_store_options: Path | None = setting(
        None, "JSON file of the store's options (e.g. endpoint_url); keys: the store's own variables"
    )
    remote_log: Literal["ack", "async"] = setting(
        "ack", "ack: a push is answered once its log bytes are in the store; async: sooner"
    )
    keep_remote_checkpoints: int = setting(2, "checkpoints kept in --checkpoint-uri (older ones deleted)", ge=1)
    object_store_timeout_s: float = setting(
        30.0, "seconds a push waits for the store before a 503 (retry)", flag="object-store-timeout", gt=0
    )
    checkpoint_upload_timeout_s: float = setting(
        600.0, "seconds shutdown waits for the last checkpoint's upload", flag="checkpoint-upload-timeout", gt=0
    )

    @model_validator(mode="after")
    def _check_store(self) -> Self:
        if self.checkpoint_uri is None:
            remote = [
                flag
                for flag, changed in (
                    ("--checkpoint-store-options", self.checkpoint_store_options is not None),
                    ("--remote-log", self.remote_log != "ack"),
                )
                if changed
            ]
            if remote:
                raise ValueError(
                    f"{', '.join(remote)} configure --checkpoint-uri: add --checkpoint-uri s3://bucket/prefix"
                )
        elif "://" not in self.checkpoint_uri:
            raise ValueError(
                f"--checkpoint-uri {self.checkpoint_uri} needs a scheme: s3://bucket/prefix (file:///path: a mount)"
            )
        if self.checkpoint_store_options is not None and not self.checkpoint_store_options.is_file():
            raise ValueError(f"--checkpoint-store-options {self.checkpoint_store_options} is not a file")
        return self
