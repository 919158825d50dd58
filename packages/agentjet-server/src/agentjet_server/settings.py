"""Server settings: one validated model, filled from CLI flags (or built directly in tests)."""

from __future__ import annotations

import ipaddress
import math
import os
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

API_KEYS_ENV = "AGENTJET_API_KEYS"
ADMIN_KEYS_ENV = "AGENTJET_ADMIN_KEYS"


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


class OptionGroup(BaseModel):
    """A group of settings, listed under its own ``panel`` in ``agentjet-server up --help``."""

    panel: ClassVar[str]
    model_config = ConfigDict(extra="forbid")


class ServingOptions(OptionGroup):
    """The HTTP server: where it listens and how long it waits for a slow peer."""

    panel: ClassVar[str] = "Serving"

    host: str = Field(default="127.0.0.1", description="interface to listen on")
    port: int = Field(default=8000, ge=0, le=65535, description="port to listen on")
    max_connections: int | None = Field(
        default=None, ge=1, description="connections held at once (default: what the open-file limit allows)"
    )
    header_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="seconds a connection may take to send request headers",
        json_schema_extra={"flag": "header-timeout"},
    )
    body_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="seconds a request body may take to arrive",
        json_schema_extra={"flag": "body-timeout"},
    )
    write_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="seconds a client may leave a streamed answer unread before it is dropped",
        json_schema_extra={"flag": "write-timeout"},
    )
    serve_only: bool = Field(
        default=False,
        description="serve the model and never learn: no learner copy is built, pushed trajectories are "
        "refused (a frozen judge or reference model)",
    )


class LimitOptions(OptionGroup):
    """What one request may ask of the server."""

    panel: ClassVar[str] = "Limits"

    max_body_bytes: int = Field(
        default=16 * 1024 * 1024, ge=1024, description="largest trajectory batch a push may send, in bytes"
    )
    max_chat_body_bytes: int = Field(
        default=4 * 1024 * 1024, ge=1024, description="largest inference request body, in bytes"
    )
    max_request_token_entries: int = Field(
        default=1 << 20, ge=1024, description="n x max_tokens x (1 + top_logprobs) one request may ask for"
    )
    default_max_tokens: int = Field(
        default=512,
        ge=1,
        description="completion tokens of a request that sets no max_tokens",
        json_schema_extra={"live": "the completion limit of requests that set none"},
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
    require_signed: bool | None = Field(
        default=None, description="train only turns this server signed (default: on whenever keys are set)"
    )
    insecure: bool = Field(default=False, description="serve a non-loopback --host without any API key")


class EngineOptions(OptionGroup):
    """The model and the engine that serves it."""

    panel: ClassVar[str] = "Model and engine"

    model: Path | None = Field(default=None, description="local Hugging Face model dir (default: embedded tiny model)")
    model_name: str | None = Field(default=None, description="name served in /v1/models")
    model_size: Literal["tiny", "small", "tools"] = Field(
        default="tiny",
        description="embedded model when no --model is given: tiny (0.66M parameters), small (1.7M), or tools (0.69M;"
        " calls the tools a request lists); all three ship prebuilt",
    )
    device: str = Field(default="cpu", description="torch device for engine and learner")
    engine: Literal["transformers", "vllm"] = Field(
        default="transformers", description="inference engine: transformers or vllm"
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto", description="engine weights: auto (fp32 CPU, bf16 GPU), float32, bfloat16"
    )
    engine_devices: str | None = Field(
        default=None,
        description="the engine's device, e.g. cuda:1, or one per replica: cuda:0,cuda:1 (default: --device)",
    )
    engine_replicas: int = Field(
        default=1,
        ge=1,
        description="engine processes serving the model (each on its own device; on CPU each with its share of the "
        "cores); requests go to the least-loaded, an episode's calls to the one holding its prefix",
    )
    tensor_parallel_size: int = Field(
        default=1, ge=1, description="vLLM: devices per engine replica, for models that need several"
    )
    gpu_memory_utilization: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description="vLLM's share of its GPU (default: what the learner's memory plan leaves on a shared GPU)",
    )
    engine_sleep: bool = Field(
        default=False,
        description="vLLM's sleep mode: during each learner step the engine frees its KV cache and moves its weights "
        "to host memory; serving pauses until the new weights are in (with --engine-replicas: the "
        "replicas on a learner's device sleep, the others serve on)",
    )
    max_batch: int = Field(default=64, ge=1, description="requests the transformers engine decodes together")
    tool_call_parser: str | None = Field(
        default=None,
        description="tool-call format of the model family: vLLM's names (hermes, llama3_json, mistral, ...)",
    )
    reasoning_parser: str | None = Field(
        default=None, description="reasoning format of the model family: vLLM's names (qwen3, deepseek_r1, ...)"
    )
    chat_template: Path | None = Field(
        default=None, description="Jinja chat template file used instead of the model's own"
    )


class BatchOptions(OptionGroup):
    """How pushed trajectories become batches: groups, staleness, admission, the task mix."""

    panel: ClassVar[str] = "Batches"

    batch_groups: int = Field(
        default=10,
        ge=1,
        description="complete GRPO groups per policy update",
        json_schema_extra={"live": "GRPO groups per step, from the next batch"},
    )
    group_size: int = Field(
        default=16,
        ge=2,
        description="episodes per task in a GRPO group",
        json_schema_extra={"live": "episodes per GRPO group, for groups that are still open"},
    )
    max_staleness: int = Field(
        default=4,
        ge=0,
        description="reject trajectories more than this many versions old",
        json_schema_extra={
            "live": "the staleness bound, for trajectories pushed from now on and batches built from now on"
        },
    )
    stale_policy: Literal["drop", "downweight"] = Field(
        default="drop",
        description="an episode past --max-staleness by the time it is trained: drop or downweight",
        json_schema_extra={
            "live": "what happens to an episode past the bound when its batch is built, from the next batch"
        },
    )
    mix: dict[str, float] = Field(
        default_factory=dict,
        description="task mix: TAG=WEIGHT,... admits (and so trains) episodes of each tag in these proportions",
        json_schema_extra={
            "live": "the task mix (tag -> weight) admission keeps trained episodes in, from the next status poll"
        },
    )
    admission_batches: int = Field(
        default=2,
        ge=1,
        description="batches' worth of episodes clients may run ahead of the learner",
        json_schema_extra={"live": "how many batches' worth of episodes runners are invited to start"},
    )
    max_buffered: int | None = Field(
        default=None,
        ge=1,
        description="trajectories held for training before pushes get 429 (default: 4 batches' worth)",
    )
    max_buffer_bytes: int = Field(
        default=2 << 30, ge=1 << 20, description="approximate memory the training buffer may hold before pushes get 429"
    )
    group_timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="seconds after which an incomplete GRPO group is trained as a smaller one",
        json_schema_extra={"flag": "group-timeout", "live": "when an incomplete group is trained as a smaller one"},
    )


class LearnerOptions(OptionGroup):
    """The learner: where and in what precision it runs, and the objective it optimises."""

    panel: ClassVar[str] = "Training"

    algorithm: Literal["grpo", "ppo"] = Field(
        default="grpo", description="grpo (group-normalised rewards) or ppo (a critic on the policy, GAE)"
    )
    lr: float = Field(
        default=0.001,
        gt=0,
        description="AdamW learning rate",
        json_schema_extra={"live": "the learner's learning rate, from the next step"},
    )
    clip_low: float = Field(
        default=0.2,
        ge=0,
        description="policy ratio clip: its lower bound is 1 - clip-low",
        json_schema_extra={"live": "the lower clip of the policy ratio, from the next step"},
    )
    clip_high: float = Field(
        default=0.28,
        ge=0,
        description="policy ratio clip: its upper bound is 1 + clip-high (DAPO's clip-higher)",
        json_schema_extra={"live": "the upper clip of the policy ratio, from the next step"},
    )
    max_grad_norm: float = Field(
        default=1.0,
        gt=0,
        description="gradient norm clip of each optimizer step",
        json_schema_extra={"live": "gradient clipping, from the next step"},
    )
    entropy_coef: float = Field(
        default=0.0,
        ge=0,
        description="entropy bonus at trained tokens (0 = off)",
        json_schema_extra={"live": "the entropy bonus, from the next step"},
    )
    off_policy: Literal["decoupled", "tis", "none"] = Field(
        default="decoupled",
        description="correction for stale turns: decoupled (AReaL), tis, or none (clip only)",
        json_schema_extra={"live": "the off-policy correction (decoupled, tis, none), from the next step"},
    )
    is_cap: float = Field(
        default=2.0,
        ge=1.0,
        description="truncation of the importance weight (decoupled, tis)",
        json_schema_extra={"live": "the importance-weight cap, from the next step"},
    )
    kl_coef: float = Field(
        default=0.0,
        ge=0,
        description="k3 KL penalty to the reference model (0 = off)",
        json_schema_extra={
            "live": "the KL penalty, from the next step (only on a server started with --kl-coef above 0)"
        },
    )
    reference: Path | None = Field(
        default=None, description="reference model dir for --kl-coef (default: the initial weights)"
    )
    mini_batches: int = Field(
        default=1,
        ge=1,
        le=64,
        description="optimizer steps per batch, each on its share",
        json_schema_extra={"live": "optimizer steps per batch, from the next step"},
    )
    gamma: float = Field(default=1.0, gt=0, le=1, description="PPO: discount per trained token")
    lam: float = Field(
        default=0.95, ge=0, le=1, description="PPO: GAE lambda", json_schema_extra={"flag": "gae-lambda"}
    )
    vf_coef: float = Field(default=0.5, ge=0, description="PPO: weight of the critic's loss")
    advantage_norm: Literal["group", "batch"] = Field(
        default="group", description="PPO: whiten advantages per group of sibling episodes (group) or over the batch"
    )
    seed: int = Field(default=0, description="random seed of the learner")
    learner_devices: str | None = Field(
        default=None,
        description="the learner's device; under torchrun one per local rank, comma-separated (default: --device)",
    )
    learner_dtype: Literal["float32", "bfloat16"] = Field(
        default="float32", description="learner compute precision: float32, or bfloat16 (autocast; fp32 master weights)"
    )
    optimizer_dtype: Literal["float32", "bfloat16"] = Field(
        default="float32", description="weights, gradients and AdamW state: float32, or bfloat16 (half the memory)"
    )
    gradient_checkpointing: bool = Field(
        default=False, description="keep only each layer's input and recompute the rest in the backward pass"
    )
    cpu_offload: bool = Field(
        default=False,
        description="FSDP2 CPU offload: the learner's weights, gradients and AdamW state in host memory, the "
        "optimizer step on the CPU (slower steps, a fraction of the GPU memory)",
    )
    lora_rank: int = Field(
        default=0, ge=0, description="train a LoRA adapter of this rank on the frozen model (0: train every weight)"
    )
    lora_alpha: float | None = Field(
        default=None, gt=0, description="LoRA: the adapter's scale is alpha / rank (default alpha: 2 x rank)"
    )
    lora_dropout: float = Field(default=0.0, ge=0, lt=1, description="LoRA: dropout on the adapter's input")
    lora_targets: str = Field(
        default="all-linear", description="LoRA: layers that get adapters: all-linear, or module names (q_proj,v_proj)"
    )
    micro_batch_tokens: int = Field(
        default=8192, ge=64, description="tokens per learner micro-batch (activation memory grows with it)"
    )
    memory_budget_gb: float | None = Field(
        default=None, gt=0, description="plan for this many GiB per device instead of the device's total memory"
    )
    memory_check: bool = Field(
        default=True, description="refuse to start when the memory plan does not fit (--no-memory-check: start anyway)"
    )


class StateOptions(OptionGroup):
    """The run's state on disk and what it reports: checkpoints, metrics, inspectable trajectories."""

    panel: ClassVar[str] = "State and metrics"

    state_dir: Path = Field(
        default=Path(".agentjet/server"), description="trajectory log and checkpoints; one server per directory"
    )
    resume: bool = Field(
        default=False, description="continue the run in --state-dir from its newest checkpoint, replaying the log"
    )
    fresh: bool = Field(default=False, description="discard an earlier run in --state-dir and start over")
    checkpoint_every: int = Field(
        default=20,
        ge=0,
        description="learner steps between checkpoints (0 = on shutdown only)",
        json_schema_extra={"live": "steps between checkpoints"},
    )
    keep_checkpoints: int = Field(
        default=2, ge=1, description="checkpoints kept in --state-dir (older ones are deleted)"
    )
    metrics: bool = Field(
        default=True,
        description="serve /metrics and the dashboard's history, and write metrics.jsonl in --state-dir"
        " (--no-metrics: none of these)",
    )
    metrics_interval_s: float = Field(
        default=60.0,
        gt=0,
        description="seconds between metrics history lines while idle",
        json_schema_extra={"flag": "metrics-interval"},
    )
    log_to: list[Literal["tensorboard", "wandb"]] = Field(
        default_factory=list,
        description="also log metrics to tensorboard or wandb (offline; repeatable; needs the package)",
    )
    keep_recent_trajectories: int = Field(
        default=200, ge=0, description="trajectory bodies kept inspectable (dashboard, inspect) after the log compacts"
    )


class ServerSettings(
    StateOptions, SecurityOptions, LimitOptions, ServingOptions, BatchOptions, LearnerOptions, EngineOptions
):
    """Every setting of a server, validated together. Each field is also an option of
    ``agentjet-server up`` (its flag, type, default and help are generated from the field) and a key
    of the job file; those marked live can change on a running server (``admin config --set``)."""

    model_config = ConfigDict(extra="forbid")

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

    @property
    def engine_device(self) -> str:
        return self.engine_device_list()[0]

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
