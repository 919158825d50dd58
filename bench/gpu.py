"""What a lent GPU measures in one short run: the transformers engine and the learner on CUDA.

    python bench/gpu.py --budget-s 300       # prints a table; exits early once the budget is spent

No vLLM on the lent machine, so the engine measured is the transformers one (bf16); vLLM on GPU
is covered by ``pytest -m gpu`` where the official wheel is installed. All ratios are measured
side by side in this run on the same model:

- engine: decode tokens/s with 8 concurrent requests vs 1 (what batching buys), and a weight
  update's time with requests in flight;
- learner: one GRPO step's time and trained tokens/s, plain module vs FSDP2 in one process
  (``fully_shard`` on a world of 1: the sharding bookkeeping's own cost), then the full-weight
  gather the engine receives.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch


def build(target: Path, hidden: int, layers: int, vocab: int) -> int:
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from agentjet_server.embedded import ensure_embedded_model

    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 256),
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


def engine_rows(model: Path, max_tokens: int) -> list[tuple[str, str]]:
    from agentjet_server.engine.hf import TransformersEngine

    engine = TransformersEngine(model, device="cuda", dtype=torch.bfloat16)
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


def learner_rows(model: Path, groups: int, steps: int) -> list[tuple[str, str]]:
    from transformers import AutoModelForCausalLM

    from agentjet_client.protocol import Trajectory, Turn
    from agentjet_server.batching.batch import build_batch
    from agentjet_server.learner import distributed
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

    rows = []
    times: dict[str, float] = {}
    for label, sharded in (("plain", False), ("FSDP2", True)):
        lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).to("cuda")
        ctx = distributed.DistContext(device="cuda")
        if sharded:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29533")
            import torch.distributed as dist

            if not dist.is_initialized():
                dist.init_process_group("nccl", rank=0, world_size=1)
            ctx = distributed.DistContext(rank=0, world_size=1, device="cuda")
            # world of 1 skips sharding in shard_model; shard by hand to measure FSDP2's bookkeeping
            from torch.distributed.fsdp import fully_shard

            for layer in distributed.decoder_layers(lm):
                fully_shard(layer)
        learner = Learner(lm, LearnerConfig(micro_batch_tokens=8192), pad_id=0, ctx=ctx)
        learner.step(batch())  # warm-up
        torch.cuda.synchronize()
        started = time.perf_counter()
        tokens = 0
        for _ in range(steps):
            stats = learner.step(batch())
            tokens += stats.trained_tokens
        torch.cuda.synchronize()
        times[label] = (time.perf_counter() - started) / steps
        rows.append((f"learner step, {label} (s)", f"{times[label]:.3f}"))
        rows.append((f"learner trained tokens/s, {label}", f"{tokens / (time.perf_counter() - started):.0f}"))
        started = time.perf_counter()
        learner.full_state_dict()
        rows.append((f"full-weight gather to CPU, {label} (ms)", f"{(time.perf_counter() - started) * 1000:.1f}"))
        del learner, lm
        torch.cuda.empty_cache()
    rows.append(("FSDP2 / plain step time", f"{times['FSDP2'] / times['plain']:.2f}x"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=420)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/gpu.py needs CUDA; on CPU use bench/engines.py and bench/latency.py")
    deadline = time.monotonic() + args.budget_s
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "m"
        params = build(model, args.hidden, args.layers, args.vocab)
        print(f"GPU: {torch.cuda.get_device_name()}  model: {params / 1e6:.1f}M parameters", flush=True)
        rows = engine_rows(model, args.max_tokens)
        for row in rows:
            print(f"  {row[0]:45} {row[1]:>12}", flush=True)
        if time.monotonic() < deadline:
            for row in learner_rows(model, args.groups, args.steps):
                print(f"  {row[0]:45} {row[1]:>12}", flush=True)
        else:
            print("  (budget spent before the learner part)")


if __name__ == "__main__":
    main()
