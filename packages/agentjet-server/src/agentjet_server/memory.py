"""The memory plan: what the engine and the learner will hold on each device, before anything loads.

``agentjet-server up`` prints it at start and refuses a layout that cannot fit, naming the flags
that would make it fit. Everything is estimated from the model's config (parameter count from a
model built on the meta device, no weights read):

- engine: its weights in the engine's dtype and its KV cache (vLLM: the share of the device that
  ``--gpu-memory-utilization`` reserves, weights included; the transformers engine: ``max_batch``
  sequences of ``KV_TOKENS`` tokens);
- learner: weights (fp32 master weights, or bf16 with ``--optimizer-dtype bfloat16``), their
  gradients, AdamW's two moments, the bf16 copies of the weights autocast keeps for the backward
  pass, a frozen reference model for a KL penalty, and the activations of one micro-batch
  (``--micro-batch-tokens``): what each decoder layer saves for backward per token (all layers, or
  with ``--gradient-checkpointing`` only each layer's input plus one layer's worth), a dense tree
  mask's attention, and the output head's logits at trained tokens;
- a fixed runtime overhead per process (torch's own allocations, or the CUDA context).

Two flags change where and when things are held. ``--cpu-offload`` (FSDP2's CPU offload) moves the
learner's weights, gradients and AdamW state to host memory; the GPU keeps the layers being computed
(the root's weights and two decoder layers, their gradients) and the activations. ``--engine-sleep``
(vLLM's sleep mode) frees the engine's KV cache and moves its weights to host memory while the
learner steps: on a device both share, the peak is the larger of serving (engine + the learner's
resident state) and stepping (the learner's all + what a sleeping engine keeps), not their sum.

The per-layer count follows what a Qwen2/Llama-style decoder layer keeps for backward: the inputs of
both norms and their outputs, q/k/v and the attention output, and the MLP's gate, up, activation and
product (``10 h + 4 i`` values per token). ``bench/memory.py`` compares the estimate with the
measured peak on CPU (docs/benchmarks.md).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from agentjet_server.model_shape import ModelShape

GIB = 1 << 30
KV_TOKENS = 2048  # context per concurrent sequence the transformers engine's KV cache is planned for
MERGED = "merged weights for the engine"
DENSE_TREE_MAX = 2048  # as learner.packing: larger trees run chain by chain, without a tree mask
RUNTIME_OVERHEAD = {"cpu": int(0.35 * GIB), "cuda": int(1.0 * GIB)}  # per process: libraries, CUDA context
HEADROOM = 0.95  # plan for at most this share of a device (fragmentation, allocator caches)
# what a vLLM engine keeps on its GPU while it sleeps (level 1 frees the KV cache and moves the
# weights to host memory; CUDA graphs and small buffers stay): an estimate until bench/gpu.py measures it
SLEEPING = "engine while asleep"
SLEEPING_BYTES = int(0.5 * GIB)

DType = Literal["float32", "bfloat16"]
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Layout:
    """Where things go and in which precision (the flags of ``agentjet-server up``)."""

    engine: str = "transformers"  # or "vllm"; "none" where this process runs no engine
    engine_device: str = "cpu"
    learner_device: str = "cpu"
    engine_dtype: str = "float32"
    learner_dtype: DType = "float32"  # compute precision of the learner's forward and backward
    optimizer_dtype: DType = "float32"  # master weights, gradients and AdamW moments
    gradient_checkpointing: bool = False
    micro_batch_tokens: int = 8192
    trained_share: float = 1.0  # share of a micro-batch's tokens that are trained (logits); 1 plans for the worst
    max_batch: int = 64  # the transformers engine's concurrent sequences
    gpu_memory_utilization: float | None = None  # vLLM's reserved share of its device
    reference: bool = False  # a frozen reference model for the KL penalty
    teacher_parameters: int = 0  # a frozen distillation teacher (--teacher) of this many parameters
    learner_ranks: int = 1  # FSDP2 shards weights, gradients and optimizer state over this many ranks
    engine_replicas: int = 1  # engine processes; on CPU they share the machine's memory
    lora_rank: int = 0  # a LoRA adapter of this rank on every linear layer instead of full fine-tuning
    adapters: int = 0  # an adapter per agent (--adapters): this many adapters of lora_rank on one base
    cpu_offload: bool = False  # FSDP2 CPU offload: weights, gradients, AdamW state in host memory
    engine_sleep: bool = False  # vLLM's sleep mode: the engine frees its GPU memory while the learner steps
    local_ranks: int = 1  # learner ranks on this machine (they share its host memory)


@dataclass
class Item:
    name: str
    bytes: int
    note: str = ""
    # when it is held: "" always; "serving" only while the engine is awake (it sleeps during steps);
    # "step" only while the learner steps (gradients, activations, autocast's copies)
    phase: str = ""
    host: bool = False  # --cpu-offload: held in host memory instead of on the learner's GPU


@dataclass
class DevicePlan:
    device: str
    capacity: int
    items: list[Item] = field(default_factory=list)

    @property
    def total(self) -> int:
        """The peak: everything held at once, or (an engine that sleeps during steps) the larger of
        serving and stepping."""
        always = sum(i.bytes for i in self.items if not i.phase)
        serving = sum(i.bytes for i in self.items if i.phase == "serving")
        step = sum(i.bytes for i in self.items if i.phase == "step")
        if serving and any(i.name == SLEEPING for i in self.items):
            return always + max(serving, step)
        return always + serving + step

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity * HEADROOM


@dataclass
class MemoryPlan:
    layout: Layout
    devices: list[DevicePlan]
    activation_bytes_per_token: int

    @property
    def fits(self) -> bool:
        return all(d.fits for d in self.devices)

    def describe(self) -> str:
        lines = []
        for d in self.devices:
            state = "fits" if d.fits else "does NOT fit"
            lines.append(
                f"{d.device}: {_gib(d.total)} of {_gib(d.capacity)} planned ({state}; at most {HEADROOM:.0%} is used)"
            )
            sleeps = any(i.name == SLEEPING for i in d.items)
            for item in d.items:
                note = item.note
                if sleeps and item.phase:
                    when = "freed while the learner steps" if item.phase == "serving" else "only during a step"
                    note = f"{note}; {when}" if note else when
                lines.append(f"  {item.name:<22} {_gib(item.bytes):>10}" + (f"  {note}" if note else ""))
        return "\n".join(lines)


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB // 10 else f"{n / (1 << 20):.1f} MiB"


def device_kind(device: str) -> str:
    return "cuda" if device.startswith("cuda") else "cpu"


def same_device(a: str, b: str) -> bool:
    """Whether two device names are one device (``cuda`` is ``cuda:0``; the CPU is one device)."""

    def canonical(device: str) -> str:
        if device_kind(device) == "cpu":
            return "cpu"
        return device if ":" in device else "cuda:0"

    return canonical(a) == canonical(b)


def local_learner_devices(settings: Any, device: str, ranks: int) -> list[str]:
    """The devices the learner ranks on this machine compute on (``device``: this process's;
    ``ranks``: the learner's world size)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if ranks > 1 else 1
    named: list[str] | None = settings.learner_device_list()
    if named:
        return named[:local]
    if ranks > 1 and device_kind(device) == "cuda":
        return [f"cuda:{i}" for i in range(local)]
    return [device]


def hosts_replica(settings: Any, device: str) -> bool:
    """Whether a torchrun rank on ``device`` shares it with an engine replica: replicas run on rank
    0's machine (torchrun's node ``GROUP_RANK`` 0), on the devices ``--engine-devices`` names."""
    if settings.engine_replicas < 2 or int(os.environ.get("GROUP_RANK", "0")) != 0:
        return False
    return any(same_device(d, device) for d in settings.engine_device_list())


def sleeping_replicas(settings: Any, learner_devices: Sequence[str]) -> list[int]:
    """``--engine-sleep --engine-replicas N``: the replicas on a device a learner rank computes on
    (they sleep through its steps; the others serve on)."""
    devices = settings.engine_device_list()
    placed = devices if len(devices) > 1 else devices * settings.engine_replicas
    return [i for i, d in enumerate(placed) if any(same_device(d, ld) for ld in learner_devices)]


def device_capacity(device: str) -> int:
    """Total memory of ``device`` (CPU: the machine's RAM)."""
    if device_kind(device) == "cuda":
        import torch

        index = int(device.split(":", 1)[1]) if ":" in device else 0
        return int(torch.cuda.get_device_properties(index).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def layer_bytes_per_token(shape: ModelShape, layout: Layout) -> int:
    """What one decoder layer keeps for backward per token: the inputs and outputs of both RMS norms
    (4 h, computed in fp32 also under bf16), and 6 h + 4 i more (q, k, v, the attention output, the
    linear layers' inputs, the MLP's gate, up, activation and product). Under autocast the residual
    stream stays fp32 and every linear layer keeps a bf16 copy of its input (one more h and i)."""
    h, i = shape.hidden, shape.intermediate
    if layout.learner_dtype == "float32":
        return (10 * h + 4 * i) * 4
    if layout.optimizer_dtype == "float32":  # autocast over fp32 weights
        return 4 * h * 4 + (7 * h + 5 * i) * 2
    return 2 * h * 4 + (8 * h + 4 * i) * 2  # all bf16: the norms' fp32 upcast remains


def activation_bytes_per_token(shape: ModelShape, layout: Layout) -> int:
    """What one micro-batch token keeps alive through the backward pass (besides attention)."""
    b = _BYTES[layout.learner_dtype]
    per_layer = layer_bytes_per_token(shape, layout)
    if layout.gradient_checkpointing:
        stored = shape.layers * shape.hidden * 4 + per_layer  # every layer's (fp32) input, one layer recomputed
    else:
        stored = shape.layers * per_layer
    logits = int(3 * shape.vocab * 4 * layout.trained_share)  # fp32 logits, log-softmax and its exp
    return stored + shape.hidden * b + logits  # and the embedding output


def adapter_parameters(shape: ModelShape, rank: int) -> int:
    """A LoRA adapter of ``rank`` on every linear layer of the decoder: r x (inputs + outputs) each."""
    h, i = shape.hidden, shape.intermediate
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    per_layer = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h)
    return shape.layers * rank * per_layer


def layer_parameters(shape: ModelShape) -> int:
    """Parameters of one decoder layer: attention (with q/k/v biases), the gated MLP, two norms."""
    h, i = shape.hidden, shape.intermediate
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    return (h * q + q) + 2 * (h * kv + kv) + q * h + 3 * h * i + 2 * h


def learner_items(shape: ModelShape, layout: Layout) -> list[Item]:
    """What the learner holds: its state (``_state_items``), what offloading gathers, precision copies, the
    frozen models, and one micro-batch's activations (``_activation_items``)."""
    p = shape.parameters
    w = _BYTES[layout.optimizer_dtype]
    compute = _BYTES[layout.learner_dtype]
    host = layout.cpu_offload
    items = _state_items(shape, layout)
    if host:
        # FSDP2 gathers a unit's whole weights onto the device to compute it (the root: embeddings,
        # final norm, head; and each decoder layer with the next one prefetched) and reduces its
        # gradients there before they go to host memory
        layer = layer_parameters(shape)
        root = max(0, p - shape.layers * layer)
        gathered = (root + 2 * layer) * w
        items.append(Item("gathered weights", gathered, "the root and two decoder layers at a time", phase="step"))
        items.append(Item("gathered gradients", gathered, "before they move to host memory", phase="step"))
    if compute < w:
        items.append(Item("bf16 weight copies", p * compute, "autocast keeps them for the backward pass", phase="step"))
    if layout.reference:
        items.append(Item("reference model", p * compute, "frozen, for the KL penalty"))
    if layout.teacher_parameters:
        teacher = layout.teacher_parameters
        items.append(Item("teacher model", teacher * compute, f"frozen, for distillation: {teacher / 1e6:.1f}M"))
    return items + _activation_items(shape, layout)


def _state_items(shape: ModelShape, layout: Layout) -> list[Item]:
    """The learner's weights, what it trains of them, their gradients and AdamW state, and what it hands the
    engine: a full fine-tune, one LoRA adapter, or an adapter per agent."""
    p = shape.parameters
    ranks = max(1, layout.learner_ranks)
    w = _BYTES[layout.optimizer_dtype]
    shard = f" (1/{ranks} per rank)" if ranks > 1 else ""
    host = layout.cpu_offload
    if layout.lora_rank and layout.adapters:  # an adapter per agent: each step trains one, the engine gets it alone
        a, n = adapter_parameters(shape, layout.lora_rank), layout.adapters
        items = [
            Item("learner weights", p * w, f"{p / 1e6:.1f}M x {w} B, frozen", host=host),
            Item("LoRA adapters", n * a * w, f"{n} x rank {layout.lora_rank}: {a / 1e6:.2f}M parameters each"),
            Item("gradients", a * w, "one adapter's at a time", phase="step"),
            Item("AdamW state", 2 * n * a * w, f"two moments per adapter, {layout.optimizer_dtype}"),
            Item("adapter handed over", a * w, "one adapter's tensors after its step", host=host),
        ]
        if device_kind(layout.learner_device) == "cpu":
            items.append(Item("peft", int(0.1 * GIB), "the library (measured)"))
    elif layout.lora_rank:
        a = adapter_parameters(shape, layout.lora_rank)
        items = [
            Item("learner weights", p * w // ranks, f"{p / 1e6:.1f}M x {w} B, frozen{shard}", host=host),
            Item("LoRA adapter", a * w // ranks, f"rank {layout.lora_rank}: {a / 1e6:.2f}M parameters", host=host),
            Item("gradients", a * w // ranks, "the adapter's only", phase="step", host=host),
            Item("AdamW state", 2 * a * w // ranks, f"two moments, {layout.optimizer_dtype}", host=host),
            # the weights handed to the engine after a step: a copy, and the merged layers; built
            # in host memory (the learner's own on a CPU learner), so not on a learner's GPU
            Item(MERGED, 2 * p * w, "built after each step", host=device_kind(layout.learner_device) == "cuda"),
        ]
        if device_kind(layout.learner_device) == "cpu":
            items.append(Item("peft", int(0.1 * GIB), "the library (measured)"))
    else:
        items = [
            Item("learner weights", p * w // ranks, f"{p / 1e6:.1f}M x {w} B{shard}", host=host),
            Item("gradients", p * w // ranks, phase="step", host=host),
            Item("AdamW state", 2 * p * w // ranks, f"two moments, {layout.optimizer_dtype}", host=host),
        ]
    return items


def _activation_items(shape: ModelShape, layout: Layout) -> list[Item]:
    """One micro-batch's activations and attention, as a dense tree or chain by chain (whichever is larger)."""
    compute = _BYTES[layout.learner_dtype]
    items: list[Item] = []
    # a micro-batch of up to DENSE_TREE_MAX tokens runs as one dense tree (checkpointed layers: always,
    # in micro-batches of at most that size) and keeps softmax(QK^T) per head and layer; a larger one
    # runs chain by chain without it. The peak is the larger of the two cases.
    per_token = activation_bytes_per_token(shape, layout)
    tokens = layout.micro_batch_tokens
    if layout.gradient_checkpointing:
        tokens = min(tokens, DENSE_TREE_MAX)
        if layout.micro_batch_tokens > tokens and device_kind(layout.learner_device) == "cpu":
            # measured (bench/memory.py): a batch cut into several micro-batches leaves the CPU
            # allocator holding about this much more than one micro-batch's peak
            items.append(Item("allocator slack", int(0.25 * GIB), "several micro-batches in a row", phase="step"))
    # a sharded learner (torchrun ranks, or --cpu-offload) runs every micro-batch as one dense tree
    # (FSDP gathers each layer once per pass): on CPU that costs what bench/memory.py measures (the
    # per-head mask expansion below: within 4% at 4,096 tokens, 35% over at 8,192); on a GPU what
    # bench/gpu.py measures (the mask term below)
    on_gpu = device_kind(layout.learner_device) == "cuda"
    sharded = layout.learner_ranks > 1 or layout.cpu_offload
    dense = tokens if sharded else min(tokens, DENSE_TREE_MAX)
    # a dense tree's mask, measured: on CPU it is kept expanded per head in every layer (about 1.25
    # bytes per query-key pair, head and layer, bench/memory.py); on a GPU each layer's attention
    # kernel turns the boolean mask into an additive one in the compute dtype and keeps it for the
    # backward pass (4 bytes per pair and layer in fp32: the 0.5B-class model's --cpu-offload step at
    # 8,192 tokens held 6.9 GiB more than the plan without it, 24 layers x 0.25 GiB). A checkpointed
    # layer recomputed in the backward pass holds its attention and the gradient of it while it
    # runs (about 112 bytes per pair in fp32, 48 in bf16, whatever the number of heads; measured on
    # CPU, and within 3% of the GPU's peaks in bench/gpu.py)
    if layout.gradient_checkpointing:
        attention = dense * dense * (112 if compute == 4 else 48)
    elif on_gpu:
        attention = shape.layers * dense * dense * compute
    else:
        attention = int(shape.layers * shape.heads * dense * dense * 1.25)
    # chain by chain, each chain's keys and values are kept whole for the chains that continue it
    chains = 4 * shape.layers * shape.kv_heads * shape.head_dim * compute
    chain_by_chain = (per_token + chains) * tokens >= per_token * dense + attention
    if not layout.gradient_checkpointing and not sharded and chain_by_chain:
        kib = f"{per_token / 1024:.0f} KiB/token x {tokens} tokens"
        items.append(Item("activations", per_token * tokens, kib, phase="step"))
        items.append(Item("chain keys and values", chains * tokens, "trees run chain by chain", phase="step"))
        if layout.lora_rank and device_kind(layout.learner_device) == "cpu":
            # measured (bench/memory.py): chain by chain, the adapters' extra temporaries leave the CPU
            # allocator holding this much more (the tensors kept for backward are fewer than without LoRA)
            items.append(Item("allocator slack", int(0.4 * per_token * tokens), "LoRA, chain by chain", phase="step"))
    else:
        kib = f"{per_token / 1024:.0f} KiB/token x {dense} tokens"
        items.append(Item("activations", per_token * dense, kib, phase="step"))
        items.append(Item("tree attention", attention, f"a dense tree of {dense} tokens", phase="step"))
    return items


def engine_items(shape: ModelShape, layout: Layout, capacity: int) -> list[Item]:
    b = _BYTES.get(layout.engine_dtype, 4)
    weights = shape.parameters * b
    kv_per_token = 2 * shape.layers * shape.kv_heads * shape.head_dim * b
    if layout.engine == "vllm" and device_kind(layout.engine_device) == "cuda":
        util = layout.gpu_memory_utilization or 0.9
        reserved = int(util * capacity)
        if reserved - weights < kv_per_token * KV_TOKENS:  # not even one sequence of KV_TOKENS fits
            reserved = weights + kv_per_token * KV_TOKENS
            util = reserved / capacity
        phase = "serving" if layout.engine_sleep else ""
        items = [
            Item("engine weights", weights, f"{layout.engine_dtype}", phase=phase),
            Item(
                "engine KV cache",
                max(0, reserved - weights),
                f"--gpu-memory-utilization {util:.2f}: {max(0, reserved - weights) // kv_per_token:,} tokens",
                phase=phase,
            ),
        ]
        if layout.engine_sleep:
            items.append(Item(SLEEPING, SLEEPING_BYTES, "CUDA graphs, buffers (estimate)", phase="step"))
        return items
    from agentjet_server.engine.hf_prompts import PROMPT_CACHE_TOKENS

    kv = layout.max_batch * KV_TOKENS * kv_per_token
    prompts = layout.max_batch * PROMPT_CACHE_TOKENS
    items = [
        Item("engine weights", weights, layout.engine_dtype),
        Item("engine KV cache", kv, f"{layout.max_batch} sequences x {KV_TOKENS} tokens"),
        Item("engine prompt cache", prompts * kv_per_token, f"{prompts} tokens"),
    ]
    if layout.lora_rank and layout.adapters:  # served on the base: each adapter once, every request its own
        a = adapter_parameters(shape, layout.lora_rank) * layout.adapters
        items.append(Item("engine adapters", a * b, f"{layout.adapters} x rank {layout.lora_rank}"))
    return items


def plan(shape: ModelShape, layout: Layout, capacity: dict[str, int]) -> MemoryPlan:
    """The plan per device; ``capacity`` maps each device of the layout to its memory."""
    devices: dict[str, DevicePlan] = {}

    def on(device: str) -> DevicePlan:
        if device not in devices:
            # host memory (for --cpu-offload) is the machine's unless the caller says otherwise
            size = capacity[device] if device in capacity or device != "cpu" else device_capacity("cpu")
            devices[device] = DevicePlan(device, size)
            overhead = RUNTIME_OVERHEAD[device_kind(device)]
            note = "CUDA context, libraries" if device_kind(device) == "cuda" else "libraries, allocator"
            devices[device].items.append(Item("runtime", overhead, note))
        return devices[device]

    engine = on(layout.engine_device)
    if layout.engine == "vllm" and device_kind(layout.engine_device) == "cuda" and not layout.gpu_memory_utilization:
        # vLLM takes what the learner leaves (all but the headroom when the learner is elsewhere)
        util = default_gpu_memory_utilization(shape, layout, engine.capacity)
        layout = replace(layout, gpu_memory_utilization=util)
    if layout.engine != "none":  # "none": a torchrun rank other than 0 (rank 0 serves)
        items = engine_items(shape, layout, engine.capacity)
        replicas = layout.engine_replicas
        if replicas > 1 and device_kind(layout.engine_device) == "cpu":
            # replica processes of their own, side by side in this machine's memory
            items = [replace(i, bytes=i.bytes * replicas, note=f"{i.note}; {replicas} replicas") for i in items]
            items.append(Item("runtime", RUNTIME_OVERHEAD["cpu"] * replicas, f"{replicas} engine processes"))
            # the fan-out's two sets of shared memory, in the engines' dtype (engine.replicas)
            b = _BYTES.get(layout.engine_dtype, 4)
            items.append(Item("weights fan-out", 2 * shape.parameters * b, "shared memory, two sets"))
        engine.items.extend(items)  # on GPUs each replica has a device like this one
    learner = on(layout.learner_device)
    items = learner_items(shape, layout)
    if device_kind(layout.learner_device) == "cpu" and layout.learner_ranks > 1:
        # torchrun's CPU ranks share this machine's memory: each holds its shard and its activations
        ranks = layout.learner_ranks
        learner.items.append(Item("runtime", RUNTIME_OVERHEAD["cpu"] * (ranks - 1), f"{ranks - 1} more ranks"))
        learner.items.extend(replace(i, bytes=i.bytes * ranks, note=f"{ranks} ranks") for i in items)
    elif device_kind(layout.learner_device) == "cuda" and any(i.host for i in items):
        # offloaded state lives in host memory, which the learner ranks of this machine share (the
        # merged weights for the engine are rank 0's alone)
        learner.items.extend(i for i in items if not i.host)
        host = on("cpu")
        local = max(1, layout.local_ranks)
        for i in items:
            if i.host:
                each = 1 if i.name == MERGED else local
                note = f"{i.note}; {local} ranks on this machine" if each > 1 else i.note
                host.items.append(replace(i, bytes=i.bytes * each, note=note.strip("; ")))
    else:
        learner.items.extend(items)
    return MemoryPlan(layout, list(devices.values()), activation_bytes_per_token(shape, layout))


def default_gpu_memory_utilization(shape: ModelShape, layout: Layout, capacity: int) -> float:
    """vLLM's share of a device it shares with the learner: what the learner leaves, at most 0.9."""
    if layout.engine_device != layout.learner_device:
        return 0.9
    # on the device: what the learner holds while the engine serves (all of it, unless the engine
    # sleeps through every step; offloaded state and the merged weights are in host memory)
    held = [i for i in learner_items(shape, layout) if not i.host]
    learner = sum(i.bytes for i in held if not (layout.engine_sleep and i.phase == "step")) + RUNTIME_OVERHEAD["cuda"]
    return max(0.05, min(0.9, math.floor(1000 * (capacity * HEADROOM - learner) / capacity) / 1000))


# what a user can change, cheapest in speed and exactness first
_REMEDIES: list[tuple[str, dict[str, Any]]] = [
    ("--gradient-checkpointing", {"gradient_checkpointing": True}),
    ("--learner-dtype bfloat16", {"learner_dtype": "bfloat16"}),
    ("--micro-batch-tokens 2048", {"micro_batch_tokens": 2048}),
    ("--dtype bfloat16", {"engine_dtype": "bfloat16"}),
    (
        "--learner-dtype bfloat16 --optimizer-dtype bfloat16",
        {"optimizer_dtype": "bfloat16", "learner_dtype": "bfloat16"},
    ),
    # these two cost speed: serving pauses during every step; the optimizer step runs on the CPU
    ("--engine-sleep", {"engine_sleep": True}),
    ("--cpu-offload", {"cpu_offload": True}),
]


def remedies(shape: ModelShape, layout: Layout, capacity: dict[str, int]) -> list[str] | None:
    """The fewest flags (cheapest first among equals) that make the plan fit; ``None``: no choice
    among them is enough."""
    from itertools import combinations

    useful = [
        (flag, change)
        for flag, change in _REMEDIES
        if any(getattr(layout, k) != v for k, v in change.items())
        and not (flag.startswith("--micro-batch-tokens") and layout.micro_batch_tokens <= 2048)
        and not (flag == "--engine-sleep" and not (layout.engine == "vllm" and _on_gpu(layout.engine_device)))
        and not (flag == "--cpu-offload" and not _on_gpu(layout.learner_device))
    ]
    for size in range(1, len(useful) + 1):
        for chosen in combinations(useful, size):
            changes: dict[str, Any] = {}
            for _flag, change in chosen:
                changes.update(change)
            if plan(shape, replace(layout, **changes), capacity).fits:
                return [flag for flag, _change in chosen]
    return None


def _on_gpu(device: str) -> bool:
    return device_kind(device) == "cuda"


# the fields of a ``Layout`` that are settings of ``up`` taken as they are
SETTINGS_AS_THEY_ARE = (
    "learner_dtype",
    "optimizer_dtype",
    "gradient_checkpointing",
    "micro_batch_tokens",
    "max_batch",
    "gpu_memory_utilization",
    "lora_rank",
    "cpu_offload",
)


def layout_for(settings: Any, learner_device: str, learner_ranks: int, serves: bool = True) -> Layout:
    """The layout ``agentjet-server up``'s settings describe for one process: ``learner_device`` is
    its rank's; the process that ``serves`` (rank 0) runs the engine, on ``--engine-devices`` or
    its own device; the other torchrun ranks hold only their learner shard."""
    from agentjet_server.engine import resolve_dtype

    engine_device = (
        (settings.engine_device_list()[0] if settings.engine_devices else learner_device) if serves else learner_device
    )
    # under torchrun, a GPU replica may sit on another rank's device: that rank plans for it (CPU
    # replicas are all in rank 0's plan)
    shared = not serves and device_kind(learner_device) == "cuda" and hosts_replica(settings, learner_device)
    engine = settings.engine if serves or shared else "none"
    engine_dtype = str(resolve_dtype(settings.dtype, engine_device)).removeprefix("torch.")
    return Layout(
        engine=engine,
        engine_device=engine_device,
        learner_device=learner_device,
        engine_dtype=engine_dtype,
        **{name: getattr(settings, name) for name in SETTINGS_AS_THEY_ARE},
        reference=settings.kl_coef > 0,
        teacher_parameters=(
            ModelShape.from_pretrained(settings.teacher).parameters
            if settings.teacher is not None and not settings.remote_teacher
            else 0  # a teacher behind a URL holds its own memory
        ),
        learner_ranks=learner_ranks,
        engine_replicas=settings.engine_replicas if serves else 1,
        # with replicas, those on a learner's device sleep through its steps
        engine_sleep=settings.engine_sleep
        and engine != "none"
        and (settings.engine_replicas == 1 or same_device(engine_device, learner_device)),
        local_ranks=int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if learner_ranks > 1 else 1,
        adapters=len(settings.adapter_names()),
    )


def capacities(layout: Layout, budget_gb: float | None) -> dict[str, int]:
    """Memory per device of the layout (``budget_gb`` instead of each device's total); host memory,
    where --cpu-offload puts the learner's state, is always the machine's."""
    devices = {layout.engine_device, layout.learner_device}
    out = {d: int(budget_gb * GIB) for d in devices} if budget_gb is not None else {}
    out.update({d: device_capacity(d) for d in devices if d not in out})
    if "cpu" not in out:
        out["cpu"] = device_capacity("cpu")
    return out


def check(
    settings: Any, model_path: str | Path, learner_device: str, learner_ranks: int, serves: bool = True
) -> MemoryPlan:
    """The plan for ``settings`` (its layout holds vLLM's share of its GPU, filled in when not given);
    raises ``ConfigError`` (naming the flags that would make it fit) when it does not fit and
    ``--memory-check`` is on."""
    from agentjet_server.errors import ConfigError

    shape = ModelShape.from_pretrained(model_path)
    layout = layout_for(settings, learner_device, learner_ranks, serves)
    capacity = capacities(layout, settings.memory_budget_gb)
    result = plan(shape, layout, capacity)
    if result.fits or not settings.memory_check:
        return result
    fixes = remedies(shape, layout, capacity)
    advice = (
        f"it would fit with {' '.join(fixes)}"
        if fixes
        else "none of --gradient-checkpointing, --learner-dtype bfloat16, --micro-batch-tokens 2048, "
        "--dtype bfloat16, --optimizer-dtype bfloat16 (with --learner-dtype bfloat16), --engine-sleep (vLLM "
        "on a GPU) and --cpu-offload (a GPU learner) is enough: put the "
        "engine and the learner on separate devices (--engine-devices / --learner-devices), shard the learner "
        "over more devices with torchrun, or use a smaller model"
    )
    raise ConfigError(
        f"the model and this layout need more memory than there is:\n{result.describe()}\n{advice}; "
        "or pass --no-memory-check to start anyway"
    )
