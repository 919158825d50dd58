"""Server settings: one validated model, filled from CLI flags (or built directly in tests)."""

from __future__ import annotations

import ipaddress
import math
import os
import re
from pathlib import Path

from pydantic import ConfigDict, field_validator, model_validator

from agentjet_server.option_groups import (
    BatchOptions,
    EngineOptions,
    LearnerOptions,
    LimitOptions,
    OptionGroup,
    SecurityOptions,
    ServingOptions,
    StateOptions,
)

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

    @field_validator("token_mask", "sequence_mask", mode="before")
    @classmethod
    def _parse_bounds(cls, value: object) -> object:
        """``--token-mask 0.5,5`` (or the pair as a list, from the admin API or a job file)."""
        if not isinstance(value, str):
            return value
        parts = [p.strip() for p in value.split(",")]
        if len(parts) != 2 or not all(parts):
            raise ValueError(f"'{value}' is not LOW,HIGH; write the bounds of pi_old / mu as 0.5,5")
        return parts

    @field_validator("token_mask", "sequence_mask")
    @classmethod
    def _check_bounds(cls, bounds: tuple[float, float] | None) -> tuple[float, float] | None:
        if bounds is not None and not (0 <= bounds[0] < 1 < bounds[1] and math.isfinite(bounds[1])):
            raise ValueError(
                f"the bounds {bounds[0]},{bounds[1]} must hold the ratio 1 between them (0 <= LOW < 1 < HIGH): "
                "pi_old / mu is 1 where the trainer and the sampler agree"
            )
        return bounds

    @model_validator(mode="after")
    def _check(self) -> ServerSettings:
        """The rules across settings: the models named, the engine and its devices, who may connect."""
        self._check_models()
        self._check_engine()
        self._check_adapters()
        self._check_access()
        return self

    def _check_models(self) -> None:
        """The model, the KL's reference and the distillation teacher exist and go with the objective."""
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
        if (self.advantage == "gae") != (self.algorithm == "ppo") and self.advantage is not None:
            raise ValueError(
                f"--advantage {self.advantage} goes with --algorithm {'ppo' if self.advantage == 'gae' else 'grpo'}: "
                "gae needs PPO's critic, and the group estimators (grpo, dr_grpo, rloo, reinforce_pp, passk) "
                "replace it"
            )
        if self.off_policy == "tis" and self.policy_loss != "ppo":
            raise ValueError(
                f"--off-policy tis is a policy loss of its own (a truncated importance-weighted policy gradient), "
                f"so it cannot go with --policy-loss {self.policy_loss}: use --off-policy decoupled or none with "
                f"{self.policy_loss}, or --policy-loss ppo with tis"
            )
        if self.overlong_penalty != 1.0 and self.overlong_buffer == 0:
            raise ValueError(
                "--overlong-penalty is the most an overlong turn costs, within --overlong-buffer tokens of its limit: "
                "set --overlong-buffer too (e.g. 64), or leave the penalty out"
            )
        if self.sequence_is and self.off_policy != "decoupled":
            raise ValueError(
                f"--sequence-is takes decoupled's importance weight per sequence, so it needs --off-policy decoupled "
                f"(the loss's ratio against pi_old); with --off-policy {self.off_policy} use --token-mask or "
                "--sequence-mask, which only leave out tokens"
            )
        if self.teacher is not None and self.algorithm == "ppo":
            raise ValueError("--teacher adds its advantage to GRPO's; with --algorithm ppo it is not supported yet")

    def _check_engine(self) -> None:
        """The engine, its precision, its devices and replicas, and the adapter it serves."""
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

    def _check_access(self) -> None:
        """Keys long enough, and no open port without one unless --insecure."""
        if any(len(k) < 8 for k in self.api_keys + self.admin_keys):
            raise ValueError("API keys must be at least 8 characters long")
        if not is_loopback(self.host) and not self.auth_enabled and not self.insecure:
            raise ValueError(
                f"--host {self.host} lets other machines reach the server, and no API key is set: anyone could "
                f"sample from and train the model. Set a key ({API_KEYS_ENV}=..., --api-key-file FILE or "
                "--api-key KEY), or pass --insecure to serve without one"
            )

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
            "--cpu-offload (the adapters switch in one learner process's own memory)": self.cpu_offload,
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
