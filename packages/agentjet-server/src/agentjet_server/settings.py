"""Server settings: one validated model, filled from CLI flags (or built directly in tests)."""

from __future__ import annotations

import ipaddress
import math
import os
import re
from pathlib import Path
from typing import Any, ClassVar, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

API_KEYS_ENV = "AGENTJET_API_KEYS"
ADMIN_KEYS_ENV = "AGENTJET_ADMIN_KEYS"
TEACHER_KEY_ENV = "AGENTJET_TEACHER_API_KEY"  # the key a --teacher URL takes, if it asks for one


def is_loopback(host: str) -> bool:
    """Whether only this machine can reach ``host``."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name other than localhost: assume it is reachable


def collect_keys(given: list[str], files: list[Path], env_var: str) -> list[str]:
    """Keys from flags, from files (one per line; blank lines and ``#`` comments skipped) and from
    the environment variable (comma- or space-separated). Files and env keep keys out of ``ps``."""
    keys = list(given)
    for path in files:
        try:
            text = path.read_text()
        except OSError as exc:
            raise ValueError(f"cannot read the key file {path}: {exc.strerror}") from exc
        keys += [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    keys += os.environ.get(env_var, "").replace(",", " ").split()
    return list(dict.fromkeys(keys))


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
        "batches' worth of episodes clients may run ahead of the learner",
        live="how many batches' worth of episodes runners are invited to start",
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


class ServerSettings(
    StateOptions, SecurityOptions, LimitOptions, ServingOptions, BatchOptions, LearnerOptions, EngineOptions
):
    """Every setting of a server, validated together. Each field is also an option of
    ``agentjet-server up`` (its flag, type, default and help are generated from the field) and a key
    of the job file; those marked live can change on a running server (``admin config --set``)."""

    model_config = ConfigDict(extra="forbid")

    @field_validator("teacher", mode="before")
    @classmethod
    def _teacher_text(cls, value: object) -> object:
        """A model dir may come as a ``Path`` (from Python); it is kept as text, as a URL is."""
        return str(value) if isinstance(value, Path) else value

    @field_validator("mix", mode="before")
    @classmethod
    def _parse_mix(cls, value: object) -> object:
        """``--mix math=3,tools=1`` (or the same as a mapping, from the admin API or a job file)."""
        if not isinstance(value, str):
            return value
        mix: dict[str, object] = {}
        for part in filter(None, (p.strip() for p in value.split(","))):
            tag, sep, weight = part.partition("=")
            if not sep or not tag.strip():
                raise ValueError(f"'{part}' is not TAG=WEIGHT; write the mix as math=3,tools=1")
            mix[tag.strip()] = weight.strip()
        return mix

    @field_validator("mix")
    @classmethod
    def _check_mix(cls, mix: dict[str, float]) -> dict[str, float]:
        for tag, weight in mix.items():
            if not 0 < len(tag) <= 128:
                raise ValueError("a mix tag must be 1-128 characters (the tag of @swarm_agent(tag=...))")
            if not (math.isfinite(weight) and weight > 0):
                raise ValueError(f"the weight of tag '{tag}' is {weight}; weights must be positive numbers")
        return mix

    @model_validator(mode="after")
    def _check(self) -> ServerSettings:
        if self.model is not None and not self.model.exists():
            hub_id = len(self.model.parts) == 2 and not str(self.model).startswith((".", "/", "~"))
            raise ValueError(
                f"--model {self.model} does not exist"
                + (
                    f"; it looks like a Hugging Face hub id, and the server loads local directories only: "
                    f"download it first (hf download {self.model} --local-dir models/{self.model.name}) and pass "
                    f"--model models/{self.model.name}"
                    if hub_id
                    else "; pass a local Hugging Face model directory, or leave --model out to use the embedded default"
                )
            )
        if self.model is not None and self.model_size != "tiny":
            raise ValueError(
                f"--model-size {self.model_size} picks a size of the embedded model; it cannot go with --model "
                "(leave one of them out)"
            )
        if self.reference is not None and not self.reference.exists():
            raise ValueError(f"--reference {self.reference} does not exist; pass a local Hugging Face model directory")
        if self.reference is not None and self.kl_coef == 0:
            raise ValueError("--reference is only used by the KL penalty: set --kl-coef above 0 (e.g. 0.01)")
        if self.teacher is not None and not self.remote_teacher and not Path(self.teacher).exists():
            raise ValueError(
                f"--teacher {self.teacher} does not exist; pass a local Hugging Face model directory or the URL "
                "(http://...) of a server that scores prompts"
            )
        if self.distill_loss == "full" and (self.teacher is None or self.remote_teacher):
            raise ValueError(
                "--distill-loss full needs the teacher's whole distribution: a local --teacher DIR (a --teacher URL "
                "answers the sampled tokens' log-probs; use --distill-loss sampled)"
            )
        if self.teacher_model is not None and not self.remote_teacher:
            raise ValueError("--teacher-model names the model of a --teacher URL; a teacher dir is its own model")
        if self.teacher is not None and self.algorithm == "ppo":
            raise ValueError("--teacher adds its advantage to GRPO's; with --algorithm ppo it is not supported yet")
        if self.engine == "vllm" and self.lora_rank and "lm_head" in self.lora_targets.replace(" ", "").split(","):
            raise ValueError(
                "--lora-targets lm_head: vLLM serves no LoRA on the output head; leave lm_head out with --engine vllm "
                "(or serve with --engine transformers)"
            )
        if self.optimizer_dtype == "bfloat16" and self.learner_dtype != "bfloat16":
            raise ValueError(
                "--optimizer-dtype bfloat16 keeps the weights themselves in bf16, so the learner computes in bf16: "
                "add --learner-dtype bfloat16"
            )
        if self.engine_sleep and self.engine != "vllm":
            raise ValueError(
                "--engine-sleep is vLLM's sleep mode (it frees the engine's GPU memory while the learner steps): "
                "add --engine vllm, or leave --engine-sleep out"
            )
        if self.gpu_memory_utilization is not None and self.engine != "vllm":
            raise ValueError("--gpu-memory-utilization sets vLLM's share of its GPU: it needs --engine vllm")
        devices = self.engine_device_list()
        if len(devices) > 1 and len(devices) != self.engine_replicas:
            raise ValueError(
                f"--engine-devices {self.engine_devices} names {len(devices)} devices for {self.engine_replicas} "
                f"engine replica(s): name one device, or one per replica (--engine-replicas {len(devices)})"
            )
        if self.engine_replicas > 1 and len(devices) == 1 and not devices[0].startswith("cpu"):
            raise ValueError(
                f"--engine-replicas {self.engine_replicas} on one {devices[0]}: each replica needs a device of its "
                "own; name them, e.g. --engine-devices cuda:0,cuda:1 (replicas share only the CPU)"
            )
        if self.lora_rank == 0 and (
            self.lora_alpha is not None or self.lora_dropout or self.lora_targets != "all-linear"
        ):
            raise ValueError("--lora-alpha, --lora-dropout and --lora-targets shape an adapter: add --lora-rank R")
        self._check_adapters()
        if self.remote_replica_ranks is not None:
            if not re.fullmatch(r"\s*\d+\s*(,\s*\d+\s*)*", self.remote_replica_ranks):
                raise ValueError(f"--remote-replica-ranks takes ranks, e.g. 8,16 (got {self.remote_replica_ranks!r})")
            if self.lora_rank:
                raise ValueError(
                    "--remote-replica-ranks publishes merged weights; with --lora-rank the engine serves an adapter: "
                    "leave one of them out"
                )
        if self.tensor_parallel_size > 1 and self.engine != "vllm":
            raise ValueError("--tensor-parallel-size splits a model over devices with vLLM: it needs --engine vllm")
        if any(len(k) < 8 for k in self.api_keys + self.admin_keys):
            raise ValueError("API keys must be at least 8 characters long")
        if not is_loopback(self.host) and not self.auth_enabled and not self.insecure:
            raise ValueError(
                f"--host {self.host} lets other machines reach the server, and no API key is set: anyone could "
                f"sample from and train the model. Set a key ({API_KEYS_ENV}=..., --api-key-file FILE or "
                "--api-key KEY), or pass --insecure to serve without one"
            )
        return self

    def adapter_names(self) -> tuple[str, ...]:
        """``--adapters`` as names (none without it)."""
        return tuple(n.strip() for n in (self.adapters or "").split(",") if n.strip())

    def _check_adapters(self) -> None:
        names = self.adapter_names()
        if not names:
            if self.adapters is not None:
                raise ValueError("--adapters names no adapter: give names, e.g. --adapters planner,executor")
            return
        if self.lora_rank == 0:
            raise ValueError("--adapters puts one LoRA adapter per agent on the frozen model: add --lora-rank R")
        bad = [n for n in names if not re.fullmatch(r"[A-Za-z0-9_.-]{1,128}", n) or n == "default"]
        if bad or len(set(names)) != len(names):
            raise ValueError(
                f"--adapters {self.adapters}: names must be distinct agent names (letters, digits, '_', '.', '-'), "
                f"not 'default' ('default' is the one adapter of --lora-rank alone)"
            )
        refused = {
            f"--engine-replicas {self.engine_replicas}": self.engine_replicas > 1,
            "--algorithm ppo (a value head per adapter)": self.algorithm == "ppo",
        }
        for what, on in refused.items():
            if on:
                raise ValueError(f"--adapters runs on one engine with GRPO for now, not with {what}")

    @property
    def remote_teacher(self) -> bool:
        """Whether --teacher is a server's URL (not a model dir)."""
        return self.teacher is not None and self.teacher.startswith(("http://", "https://"))

    @property
    def engine_device(self) -> str:
        return self.engine_device_list()[0]

    def remote_replica_list(self) -> tuple[int, ...]:
        """``--remote-replica-ranks`` as ranks (none without it)."""
        return tuple(sorted({int(r) for r in (self.remote_replica_ranks or "").split(",") if r.strip()}))

    def engine_device_list(self) -> list[str]:
        """``--engine-devices`` as a list (one entry: every replica there), else ``--device``."""
        named = [d.strip() for d in (self.engine_devices or "").split(",") if d.strip()]
        return named or [self.device]

    def learner_device_list(self) -> list[str] | None:
        """``--learner-devices`` as a list (None: ``--device``, one per local rank on GPUs)."""
        if not self.learner_devices:
            return None
        return [d.strip() for d in self.learner_devices.split(",") if d.strip()]

    @property
    def auth_enabled(self) -> bool:
        return bool(self.api_keys or self.admin_keys)

    @property
    def signatures_required(self) -> bool:
        return self.require_signed if self.require_signed is not None else self.auth_enabled


def flag_of(name: str) -> str | None:
    """The ``up`` flag of a setting (``group-timeout`` for ``group_timeout_s``), None for those that are
    no flag of their own (keys: from ``--api-key``, key files and the environment)."""
    extra = ServerSettings.model_fields[name].json_schema_extra
    flag = extra.get("flag", name.replace("_", "-")) if isinstance(extra, dict) else name.replace("_", "-")
    return flag if isinstance(flag, str) else None


# ServerSettings' bases, in the order ``up --help`` lists their panels
OPTION_GROUPS: tuple[type[OptionGroup], ...] = (
    EngineOptions,
    LearnerOptions,
    BatchOptions,
    ServingOptions,
    LimitOptions,
    SecurityOptions,
    StateOptions,
)


def panel_of(name: str) -> str:
    """The heading a setting is listed under in ``up --help``: that of the options class declaring it."""
    for group in OPTION_GROUPS:
        if name in group.model_fields:
            return group.panel
    raise KeyError(name)


def live_settings() -> dict[str, str]:
    """The settings a running server takes (``admin config --set``), and what each changes when."""
    out = {}
    for name, field in ServerSettings.model_fields.items():
        extra = field.json_schema_extra
        if isinstance(extra, dict) and isinstance(extra.get("live"), str):
            out[name] = str(extra["live"])
    return out
