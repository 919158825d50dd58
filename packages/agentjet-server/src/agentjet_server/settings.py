"""Server settings: one validated model, filled from CLI flags (or built directly in tests)."""

from __future__ import annotations

import ipaddress
import math
import os
from pathlib import Path
from typing import Literal

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


class ServerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    model: Path | None = Field(default=None, description="local HF model dir; None = embedded default")
    model_name: str | None = None
    model_size: Literal["tiny", "small", "tools"] = Field(
        default="tiny", description="size of the embedded model when no --model is given"
    )
    state_dir: Path = Path(".agentjet/server")
    resume: bool = Field(default=False, description="continue the run in state_dir from its newest checkpoint")
    fresh: bool = Field(default=False, description="discard an earlier run in state_dir")
    checkpoint_every: int = Field(default=20, ge=0, description="steps between checkpoints; 0 = on shutdown only")
    keep_checkpoints: int = Field(default=2, ge=1)
    device: str = "cpu"
    engine: Literal["transformers", "vllm"] = "transformers"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    engine_devices: str | None = Field(
        default=None, description="the engine's device, or one per replica (comma-separated); None = --device"
    )
    engine_replicas: int = Field(default=1, ge=1, description="engine processes serving the model, requests routed")
    tensor_parallel_size: int = Field(default=1, ge=1, description="vLLM: devices per engine replica")
    learner_devices: str | None = Field(
        default=None, description="the learner's device (under torchrun: one per local rank, comma-separated)"
    )
    gpu_memory_utilization: float | None = Field(
        default=None, gt=0, le=1, description="vLLM's share of its GPU; None = what the learner leaves on a shared one"
    )
    learner_dtype: Literal["float32", "bfloat16"] = Field(
        default="float32", description="the learner's compute precision (bfloat16: autocast)"
    )
    optimizer_dtype: Literal["float32", "bfloat16"] = Field(
        default="float32", description="master weights, gradients and AdamW state (bfloat16 halves them)"
    )
    gradient_checkpointing: bool = Field(default=False, description="recompute activations in the backward pass")
    cpu_offload: bool = Field(
        default=False, description="FSDP2 CPU offload: the learner's weights, gradients and AdamW state in host memory"
    )
    engine_sleep: bool = Field(
        default=False, description="vLLM's sleep mode: free the engine's GPU memory while the learner steps"
    )
    lora_rank: int = Field(default=0, ge=0, description="train a LoRA adapter of this rank (0: every weight)")
    lora_alpha: float | None = Field(default=None, gt=0, description="LoRA scale numerator; None = 2 x rank")
    lora_dropout: float = Field(default=0.0, ge=0, lt=1, description="dropout on the adapter's input")
    lora_targets: str = Field(
        default="all-linear", description="layers that get adapters: all-linear, or names such as q_proj,v_proj"
    )
    micro_batch_tokens: int = Field(default=8192, ge=64, description="prefix-tree nodes per learner micro-batch")
    memory_budget_gb: float | None = Field(
        default=None, gt=0, description="plan for this many GiB per device instead of the device's total"
    )
    memory_check: bool = Field(default=True, description="refuse a layout whose memory plan does not fit")
    tool_call_parser: str | None = Field(
        default=None, description="tool-call format of the model family (vLLM's parser names; built-in: hermes)"
    )
    reasoning_parser: str | None = Field(default=None, description="reasoning format (vLLM's reasoning parser names)")
    chat_template: Path | None = Field(default=None, description="Jinja chat template file overriding the model's")
    algorithm: Literal["grpo", "ppo"] = "grpo"
    batch_groups: int = Field(default=10, ge=1)
    group_size: int = Field(default=16, ge=2)
    max_staleness: int = Field(default=4, ge=0)
    lr: float = Field(default=1e-3, gt=0)
    clip_low: float = Field(default=0.2, ge=0)
    clip_high: float = Field(default=0.28, ge=0)
    max_grad_norm: float = Field(default=1.0, gt=0)
    entropy_coef: float = Field(default=0.0, ge=0)
    stale_policy: Literal["drop", "downweight"] = Field(
        default="drop", description="an episode past max_staleness when its batch is built"
    )
    off_policy: Literal["decoupled", "tis", "none"] = "decoupled"
    is_cap: float = Field(default=2.0, ge=1.0, description="truncation of the behaviour importance weight")
    kl_coef: float = Field(default=0.0, ge=0, description="k3 KL penalty to the reference model")
    reference: Path | None = Field(default=None, description="reference model dir; None = the initial weights")
    mini_batches: int = Field(default=1, ge=1, le=64, description="optimizer steps per batch")
    gamma: float = Field(default=1.0, gt=0, le=1)
    lam: float = Field(default=0.95, ge=0, le=1)
    vf_coef: float = Field(default=0.5, ge=0)
    mix: dict[str, float] = Field(
        default_factory=dict,
        description="task tag -> weight: admission keeps trained episodes in these proportions (math=3,tools=1)",
    )
    advantage_norm: Literal["group", "batch"] = Field(
        default="group", description="PPO: whiten advantages per group of sibling episodes, or over the batch"
    )
    admission_batches: int = Field(
        default=2, ge=1, description="batches' worth of episodes the server invites ahead of training"
    )
    max_buffered: int | None = Field(
        default=None, ge=1, description="trajectories held for training; None = 4 x admission target"
    )
    max_buffer_bytes: int = Field(default=2 << 30, ge=1 << 20, description="approximate memory of the buffer")
    group_timeout_s: float = Field(
        default=600.0, gt=0, description="an incomplete GRPO group is trained as a smaller one after this long"
    )
    default_max_tokens: int = Field(default=512, ge=1)
    max_batch: int = Field(default=64, ge=1)
    max_body_bytes: int = Field(default=16 * 1024 * 1024, ge=1024, description="largest trajectory batch")
    max_chat_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024, description="largest inference request")
    body_timeout_s: float = Field(default=30.0, gt=0, description="a request body must arrive within this")
    header_timeout_s: float = Field(default=10.0, gt=0, description="request headers must arrive within this")
    write_timeout_s: float = Field(default=60.0, gt=0, description="a reader that reads nothing this long is dropped")
    max_connections: int | None = Field(default=None, ge=1, description="None = what the open-file limit allows")
    max_request_token_entries: int = Field(
        default=1 << 20, ge=1024, description="n x max_tokens x (1 + top_logprobs) one request may ask for"
    )
    api_keys: list[str] = Field(default_factory=list)
    admin_keys: list[str] = Field(default_factory=list)
    require_signed: bool | None = Field(
        default=None, description="train only turns signed by this server; None = whenever API keys are set"
    )
    insecure: bool = Field(default=False, description="allow a non-loopback --host without API keys")
    seed: int = 0
    metrics: bool = Field(default=True, description="serve /metrics and write <state-dir>/metrics.jsonl")
    metrics_interval_s: float = Field(default=60.0, gt=0, description="seconds between history lines while idle")
    log_to: list[Literal["tensorboard", "wandb"]] = Field(
        default_factory=list, description="also send the metrics history to these (extras, when installed)"
    )
    keep_recent_trajectories: int = Field(
        default=200, ge=0, description="trajectory bodies kept inspectable after the log compacts them"
    )

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
            raise ValueError(
                f"--model {self.model} does not exist; pass a local Hugging Face model directory, "
                "or leave --model out to use the embedded default"
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
