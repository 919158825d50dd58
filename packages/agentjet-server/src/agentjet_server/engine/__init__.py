"""Inference engines behind one interface (see ``base``): ``transformers`` (default) and ``vllm``."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch

from agentjet_server.engine.adapter import LoraSpec
from agentjet_server.engine.base import Engine, EngineOptions, SamplingParams, TokenEvent
from agentjet_server.errors import ConfigError

EngineKind = Literal["transformers", "vllm"]
DType = Literal["auto", "float32", "bfloat16", "float16"]


def resolve_dtype(dtype: DType, device: str) -> torch.dtype:
    """``auto``: float32 on CPU (exact logprobs for the tiny models), bfloat16 on GPU."""
    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return getattr(torch, dtype)  # type: ignore[no-any-return]


def create_engine(
    kind: EngineKind,
    model_path: Path,
    *,
    model_name: str | None,
    device: str,
    max_batch: int,
    dtype: DType = "auto",
    version: int = 0,
    chat_template: str | None = None,
    gpu_memory_utilization: float | None = None,
    tensor_parallel_size: int = 1,
    lora: LoraSpec | None = None,
    sleep_mode: bool = False,
    adapters: tuple[str, ...] = (),
    adapter_versions: tuple[tuple[str, int], ...] = (),
) -> Engine:
    """The engine ``agentjet-server up --engine KIND`` serves with. ``lora``: vLLM serves the LoRA
    adapter the learner trains (the transformers engine takes merged weights); with ``adapters`` (an
    adapter per agent, each at its version in ``adapter_versions``), the transformers engine serves them
    all on one frozen base, each adapter of ``lora``."""
    options = EngineOptions(
        model_name=model_name,
        device=device,
        dtype=resolve_dtype(dtype, device),
        max_batch=max_batch,
        version=version,
        chat_template=chat_template,
        adapters=adapters,
        lora=lora if adapters else None,
        adapter_versions=adapter_versions,
    )
    if kind == "vllm":
        from agentjet_server.engine.vllm import VLLMEngine

        engine_args: dict[str, object] = {}
        if gpu_memory_utilization:
            engine_args["gpu_memory_utilization"] = gpu_memory_utilization
        if tensor_parallel_size > 1:
            engine_args["tensor_parallel_size"] = tensor_parallel_size
        return VLLMEngine(model_path, options, engine_args=engine_args or None, lora=lora, sleep_mode=sleep_mode)
    if sleep_mode:
        raise ConfigError("--engine-sleep is vLLM's sleep mode: it needs --engine vllm")
    from agentjet_server.engine.hf import TransformersEngine

    return TransformersEngine(model_path, options)


__all__ = [
    "DType",
    "Engine",
    "EngineKind",
    "EngineOptions",
    "SamplingParams",
    "TokenEvent",
    "create_engine",
    "resolve_dtype",
]
