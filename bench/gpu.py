"""What a lent GPU measures in one short run: engines, replicas, the learner's layouts and LoRA on CUDA.

    python bench/gpu.py --budget-s 420          # prints tables; skips what the budget no longer allows
    python bench/gpu.py --qwen-0.5b             # the model built from Qwen2.5-0.5B's published shape
    python bench/gpu.py --smoke                 # a tiny model on CPU: checks the script runs (no figures)
    python bench/gpu.py --parts layouts,learner # only these parts, in this order

No vLLM on the lent machine, so the engine measured is the transformers one (bf16); vLLM on GPU
is covered by ``pytest -m gpu`` where the official wheel is installed. All ratios are measured
side by side in this run on the same model (random weights built from a config):

- engine: decode tokens/s with 8 concurrent requests vs 1 (what batching buys), a weight update's
  time with requests in flight, and staggered arrivals (48 requests one every 20 ms) continuously
  batched vs in waves: first-token latency and tokens/s;
- replicas: two engine processes on the same GPU against one engine (``ReplicaSet``): tokens/s
  with 16 concurrent requests, and the weight fan-out's time against one engine's update;
- learner layouts (fp32, checkpointing, bf16 autocast, all-bf16, LoRA rank 16, LoRA +
  checkpointing, two adapters of rank 16 (an adapter per agent), FSDP2 CPU offload alone and with
  all-bf16 + checkpointing): step time and
  peak CUDA memory (``max_memory_allocated``) next to the memory
  plan's estimate for the same layout (runtime excluded: the allocator does not see it);
- learner: one GRPO step's time and trained tokens/s, plain module vs FSDP2 in one process
  (``fully_shard`` on a world of 1: the sharding bookkeeping's own cost), then the full-weight
  gather the engine receives.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from agentjet_server.learner.distributed import DistContext


def build(
    target: Path,
    hidden: int,
    layers: int,
    vocab: int,
    intermediate: int | None = None,
    heads: int | None = None,
    kv_heads: int | None = None,
) -> int:
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from agentjet_server.embedded import ensure_embedded_model

    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate or hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=heads or hidden // 64,
        num_key_value_heads=kv_heads or max(1, hidden // 256),
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(target)
    AutoTokenizer.from_pretrained(ensure_embedded_model()).save_pretrained(target)
    return sum(p.numel() for p in model.parameters())


async def _burst(engine: Any, prompt: list[int], n: int, max_tokens: int) -> int:
    from agentjet_server.engine.base import SamplingParams

    async def one(seed: int) -> int:
        return len([e async for e in engine.generate(prompt, SamplingParams(max_tokens=max_tokens, seed=seed))])

    return sum(await asyncio.gather(*(one(i) for i in range(n))))


def engine_rows(model: Path, max_tokens: int, device: str, dtype: torch.dtype) -> list[tuple[str, str]]:
    from agentjet_server.engine.base import EngineOptions
    from agentjet_server.engine.hf import TransformersEngine

    engine = TransformersEngine(model, EngineOptions(device=device, dtype=dtype))
    prompt = engine.render([{"role": "user", "content": "Tell me a long story."}])
    asyncio.run(_burst(engine, prompt, 2, 8))
    rates = {}
    for n in (1, 8):
        started = time.perf_counter()
        tokens = asyncio.run(_burst(engine, prompt, n, max_tokens))
        rates[n] = tokens / (time.perf_counter() - started)
    weights = {k: v.float().cpu() for k, v in engine.model.state_dict().items()}
    took: list[float] = []

    def push() -> None:
        time.sleep(0.2)
        started = time.perf_counter()
        engine.update_weights(weights, 1)
        took.append(time.perf_counter() - started)

    thread = threading.Thread(target=push)
    thread.start()
    asyncio.run(_burst(engine, prompt, 8, max_tokens))
    thread.join()
    engine.close()
    return [
        ("engine tokens/s, 1 request", f"{rates[1]:.0f}"),
        ("engine tokens/s, 8 concurrent", f"{rates[8]:.0f}"),
        ("batching speed-up (8 vs 1)", f"{rates[8] / rates[1]:.2f}x"),
        ("weight update with 8 in flight (ms)", f"{took[0] * 1000:.1f}"),
    ]


def staggered_rows(model: Path, device: str, dtype: torch.dtype) -> list[tuple[str, str]]:
    import sys

    from agentjet_server.engine.base import EngineOptions
    from agentjet_server.engine.hf import TransformersEngine

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from engines import _staggered  # bench/engines.py: the same staggered workload

    rows = []
    for label, continuous in (("waves", False), ("continuous", True)):
        engine = TransformersEngine(model, EngineOptions(device=device, dtype=dtype), continuous=continuous)
        prompts = [engine.render([{"role": "user", "content": f"Tell me about item {i}."}]) for i in range(8)]
        asyncio.run(_burst(engine, prompts[0], 2, 8))
        result = asyncio.run(_staggered(engine, prompts, 48, 0.02))
        engine.close()
        first = sorted(result["first"])
        rows.append((f"staggered, {label}: first token p50 (ms)", f"{first[len(first) // 2] * 1000:.1f}"))
        rows.append((f"staggered, {label}: tokens/s", f"{result['stagger_tokens_per_s']:.0f}"))
    return rows


def replica_rows(model: Path, device: str, max_tokens: int) -> list[tuple[str, str]]:
    from agentjet_server.engine import create_engine
    from agentjet_server.engine.replicas import ReplicaSet, cpu_threads_per_replica

    options: dict[str, Any] = {
        "model_name": "bench",
        "max_batch": 64,
        "dtype": "bfloat16" if device != "cpu" else "float32",
    }
    rows = []
    rates, updates = {}, {}
    for label in ("1 engine", "2 replicas"):
        if label == "1 engine":
            engine: Any = create_engine("transformers", model, device=device, **options)
        else:
            threads = cpu_threads_per_replica(2) if device == "cpu" else None  # as `up` does on CPU
            engine = ReplicaSet("transformers", model, replicas=2, devices=[device], threads=threads, **options)
        prompt = engine.render([{"role": "user", "content": "Tell me a long story."}])
        asyncio.run(_burst(engine, prompt, 4, 8))
        started = time.perf_counter()
        tokens = asyncio.run(_burst(engine, prompt, 16, max_tokens))
        rates[label] = tokens / (time.perf_counter() - started)
        from transformers import AutoModelForCausalLM

        weights = AutoModelForCausalLM.from_pretrained(model).state_dict()
        took = []
        for version in (1, 2, 3):  # new tensors each time, as the learner hands them over
            fresh = {name: tensor.clone() for name, tensor in weights.items()}
            started = time.perf_counter()
            engine.update_weights(fresh, version)
            took.append(time.perf_counter() - started)
        updates[label] = took[-1]
        engine.close()
        rows.append((f"{label}: tokens/s, 16 concurrent", f"{rates[label]:.0f}"))
        rows.append((f"{label}: weight update, 1st / 3rd (ms)", f"{took[0] * 1000:.0f} / {took[-1] * 1000:.0f}"))
    rows.append(("2 replicas / 1 engine, tokens/s", f"{rates['2 replicas'] / rates['1 engine']:.2f}x"))
    rows.append(("fan-out to 2 / one update, 3rd", f"{updates['2 replicas'] / updates['1 engine']:.2f}x"))
    return rows


LAYOUTS: dict[str, dict[str, Any]] = {
    "fp32": {},
    "checkpointing": {"gradient_checkpointing": True},
    "bf16 autocast": {"learner_dtype": "bfloat16"},
    "all bf16": {"learner_dtype": "bfloat16", "optimizer_dtype": "bfloat16"},
    "LoRA rank 16": {"lora_rank": 16},
    "LoRA rank 16 + checkpointing": {"lora_rank": 16, "gradient_checkpointing": True},
    # an adapter per agent (--adapters): two adapters of rank 16 on one base, each step trains one of them
    "2 adapters of rank 16": {"lora_rank": 16, "adapters": 2},
    # FSDP2 CPU offload in one process: the device holds what is being computed, host memory the rest
    "CPU offload": {"cpu_offload": True},
    "CPU offload + all bf16 + checkpointing": {
        "cpu_offload": True,
        "learner_dtype": "bfloat16",
        "optimizer_dtype": "bfloat16",
        "gradient_checkpointing": True,
    },
}


def layout_rows(model: Path, device: str, steps: int, deadline: float) -> list[tuple[str, str]]:
    """Each layout: step time and peak memory against the plan (CUDA only for memory)."""
    from transformers import AutoModelForCausalLM

    from agentjet_server.engine.adapter import LoraSpec
    from agentjet_server.learner.batch import Batch, Sequence
    from agentjet_server.learner.distributed import DistContext
    from agentjet_server.learner.trainer import Learner, LearnerConfig
    from agentjet_server.memory import Layout, learner_items
    from agentjet_server.model_shape import ModelShape

    shape = ModelShape.from_pretrained(model)
    generator = torch.Generator().manual_seed(0)
    sequences = []
    for i in range(8):  # 8 x 1024 tokens, 512 trained each: one 8,192-token micro-batch
        ids = torch.randint(10, 1000, (1024,), generator=generator).tolist()
        trained = list(range(512, 1024))
        sequences.append(Sequence(ids, trained, [-1.0] * len(trained), [1.0 if i % 2 else -1.0] * len(trained)))
    batch = Batch(sequences, [0.0] * len(sequences), 1, 0, len(sequences))
    rows = []
    full_step = None
    for name, layout in LAYOUTS.items():
        if time.monotonic() > deadline:
            rows.append((f"{name}", "(budget spent)"))
            continue
        pure = layout.get("optimizer_dtype") == "bfloat16"
        offload = bool(layout.get("cpu_offload", False))
        net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16 if pure else torch.float32)
        net = net.to("cpu" if offload else device)  # offloaded: FSDP keeps the shards in host memory
        rank = int(layout.get("lora_rank", 0))
        config = LearnerConfig(
            compute_dtype=layout.get("learner_dtype", "float32"),
            gradient_checkpointing=bool(layout.get("gradient_checkpointing", False)),
            lora=LoraSpec(rank=rank, alpha=2.0 * rank) if rank else None,
            cpu_offload=offload,
            adapters=tuple(f"agent{i}" for i in range(int(layout.get("adapters", 0)))),
        )
        names = config.adapters or (None,)  # with adapters, the steps take turns
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        learner = Learner(net, config, pad_id=0, ctx=DistContext(device=device))
        for name_ in names:  # warm-up; creates the optimizer state (every adapter's)
            learner.step(batch, name_)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        started = time.perf_counter()
        for i in range(steps):
            learner.step(batch, names[i % len(names)])
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        took = (time.perf_counter() - started) / steps
        full_step = full_step or took
        plan = Layout(learner_device=device, micro_batch_tokens=8192, trained_share=0.5, **layout)
        items = [i for i in learner_items(shape, plan) if i.name not in ("peft", "allocator slack")]
        estimate = sum(i.bytes for i in items if not i.host)  # the device's share (offloaded: host's excluded)
        if device.startswith("cuda"):
            peak = torch.cuda.max_memory_allocated()
            memory = f"{peak / 2**30:.2f} GiB (plan {estimate / 2**30:.2f}, {estimate / peak:.2f})"
        else:
            memory = f"n/a on CPU (plan {estimate / 2**30:.2f} GiB)"
        rows.append((f"{name}: step (s), vs fp32", f"{took:.3f} ({took / full_step:.2f}x)"))
        rows.append((f"{name}: trainable parameters", f"{learner.trainable_parameters / 1e6:.1f}M"))
        rows.append((f"{name}: peak memory", memory))
        if offload:
            host = sum(i.bytes for i in items if i.host)
            rows.append((f"{name}: in host memory (plan)", f"{host / 2**30:.2f} GiB"))
        del learner, net
    return rows


class _ShardedAlone(DistContext):
    @property
    def enabled(self) -> bool:
        return True


def learner_rows(model: Path, device: str, groups: int, steps: int) -> list[tuple[str, str]]:
    from transformers import AutoModelForCausalLM

    from agentjet_client.protocol import Trajectory, Turn
    from agentjet_server.learner import distributed
    from agentjet_server.learner.batch import build_batch
    from agentjet_server.learner.trainer import Learner, LearnerConfig

    rng = random.Random(0)

    def batch() -> Any:
        out = []
        for g in range(groups):
            prompt = [rng.randrange(1000) for _ in range(512)]
            out.append(
                [
                    Trajectory(
                        id=f"{g}-{i}-{rng.random()}",
                        task_id=str(g),
                        reward=float(i % 2),
                        turns=[
                            Turn(
                                policy_version=0,
                                prompt_token_ids=prompt,
                                completion_token_ids=[rng.randrange(1000) for _ in range(256)],
                                completion_logprobs=[-2.0] * 256,
                                finish_reason="length",
                            )
                        ],
                    )
                    for i in range(8)
                ]
            )
        return build_batch(out)

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    rows = []
    times: dict[str, float] = {}
    for label, sharded in (("plain", False), ("FSDP2", True)):
        lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).to(device)
        # shard_model leaves a world of 1 alone; a context that counts as distributed makes it shard
        # as for several ranks (a unit per decoder layer, the policy as root) over a group of one, so
        # the difference is FSDP2's own bookkeeping
        ctx = _ShardedAlone(device=device) if sharded else distributed.DistContext(device=device)
        learner = Learner(lm, LearnerConfig(micro_batch_tokens=8192), pad_id=0, ctx=ctx)
        learner.step(batch())  # warm-up
        sync()
        started = time.perf_counter()
        tokens = 0
        for _ in range(steps):
            stats = learner.step(batch())
            tokens += stats.trained_tokens
        sync()
        times[label] = (time.perf_counter() - started) / steps
        rows.append((f"learner step, {label} (s)", f"{times[label]:.3f}"))
        rows.append((f"learner trained tokens/s, {label}", f"{tokens / (time.perf_counter() - started):.0f}"))
        started = time.perf_counter()
        learner.full_state_dict()
        rows.append((f"full-weight gather to CPU, {label} (ms)", f"{(time.perf_counter() - started) * 1000:.1f}"))
        del learner, lm
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    rows.append(("FSDP2 / plain step time", f"{times['FSDP2'] / times['plain']:.2f}x"))
    return rows


PARTS = {
    "engine": "engine",
    "staggered": "staggered arrivals",
    "replicas": "replicas",
    "layouts": "learner layouts",
    "learner": "learner, plain vs FSDP2",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--qwen-0.5b", dest="qwen", action="store_true", help="Qwen2.5-0.5B's shape (494M)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=420)
    parser.add_argument("--smoke", action="store_true", help="a tiny model on CPU: only checks that it runs")
    parser.add_argument(
        "--parts",
        default=",".join(PARTS),
        help=f"comma-separated, in the order given (default: all of {','.join(PARTS)})",
    )
    args = parser.parse_args()
    chosen = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in chosen if p not in PARTS]
    if unknown:
        raise SystemExit(f"unknown part(s) {', '.join(unknown)}: choose from {', '.join(PARTS)}")
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("bench/gpu.py needs CUDA; on CPU use bench/engines.py and bench/latency.py (or --smoke)")
    device = "cpu" if args.smoke else "cuda"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    deadline = time.monotonic() + args.budget_s
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "m"
        if args.smoke:
            params = build(model, 128, 2, 1024)
        elif args.qwen:
            params = build(model, 896, 24, 151936, intermediate=4864, heads=14, kv_heads=2)
        else:
            params = build(model, args.hidden, args.layers, args.vocab)
        name = torch.cuda.get_device_name() if device == "cuda" else "CPU (smoke run)"
        print(f"device: {name}  model: {params / 1e6:.1f}M parameters", flush=True)
        measures = {
            "engine": lambda: engine_rows(model, args.max_tokens, device, dtype),
            "staggered": lambda: staggered_rows(model, device, dtype),
            "replicas": lambda: replica_rows(model, device, args.max_tokens),
            "layouts": lambda: layout_rows(model, device, args.steps, deadline),
            "learner": lambda: learner_rows(model, device, 1 if args.smoke else args.groups, args.steps),
        }
        for part in chosen:
            title = PARTS[part]
            if time.monotonic() > deadline:
                print(f"{title}: budget spent, skipped", flush=True)
                continue
            print(f"{title}:", flush=True)
            started = time.monotonic()
            for row in measures[part]():
                print(f"  {row[0]:45} {row[1]:>12}", flush=True)
            print(f"  ({time.monotonic() - started:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
