"""vLLM engine vs transformers engine, same model, same requests, measured side by side in one run.

The transformers engine is measured twice: continuously batched (what it serves with) and in waves
(``continuous=False``: a newcomer waits for the running batch to finish, as it did before).

    .venv-vllm/bin/python bench/engines.py   # needs vLLM: `python3 scripts/dev.py test-vllm` sets up .venv-vllm
    .venv-vllm/bin/python bench/engines.py --size small --concurrency 8 --max-tokens 128

For each engine, in its own subprocess (vLLM sets process-wide torch state) with the same
thread count: decode throughput with N concurrent requests; 48 requests of 16-256 tokens arriving
one every 20 ms, three times (median throughput, time to first token); then a weight update pushed while N
requests are in flight — the update's time as the learner sees it, and the longest gap between
two tokens any request saw around it, next to the same engine's usual inter-token gap.

The model is the embedded model's architecture with random weights (so completions run to
``--max-tokens``), or a larger one with ``--size small``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ENGINES = ("waves", "transformers", "vllm")
SIZES = {
    "tiny": {},  # the embedded model's architecture
    "small": {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8, "num_attention_heads": 8},
}


def build_model(size: str, target: Path) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from agentjet_server.embedded import ensure_embedded_model

    source = ensure_embedded_model()
    base = AutoConfig.from_pretrained(source)
    settings = {**base.to_dict(), **SIZES[size]}
    if size != "tiny":
        settings.pop("layer_types", None)
        settings["num_key_value_heads"] = settings["num_attention_heads"] // 2
        settings["head_dim"] = settings["hidden_size"] // settings["num_attention_heads"]
    config = type(base)(**settings)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(target)
    AutoTokenizer.from_pretrained(source).save_pretrained(target)
    params = sum(p.numel() for p in model.parameters())
    (target / "params.txt").write_text(str(params))
    return target


async def _one(engine: Any, prompt: list[int], params: Any, stamps: list[float]) -> int:
    count = 0
    async for _ in engine.generate(prompt, params):
        stamps.append(time.perf_counter())
        count += 1
    return count


async def _burst(
    engine: Any, prompts: list[list[int]], max_tokens: int, seed: int
) -> tuple[int, float, list[list[float]]]:
    from agentjet_server.engine.base import SamplingParams

    stamps: list[list[float]] = [[] for _ in prompts]
    started = time.perf_counter()
    counts = await asyncio.gather(
        *(
            _one(engine, p, SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed + i), stamps[i])
            for i, p in enumerate(prompts)
        )
    )
    return sum(counts), time.perf_counter() - started, stamps


async def _staggered(engine: Any, prompts: list[list[int]], arrivals: int, gap_s: float) -> dict[str, Any]:
    """Requests arriving one every ``gap_s`` with lengths from 16 to 256 tokens, like agents' turns:
    the time to first token shows whether a newcomer waits for the batch that is already running."""
    from agentjet_server.engine.base import SamplingParams

    first: list[float] = []
    counts: list[int] = []

    async def one(i: int) -> None:
        await asyncio.sleep(i * gap_s)
        sent, n = time.perf_counter(), 0
        params = SamplingParams(max_tokens=16 + (i * 97) % 241, temperature=1.0, seed=i)
        async for _ in engine.generate(prompts[i % len(prompts)], params):
            if n == 0:
                first.append(time.perf_counter() - sent)
            n += 1
        counts.append(n)

    started = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(arrivals)))
    return {"stagger_tokens_per_s": sum(counts) / (time.perf_counter() - started), "first": first}


def measure(kind: str, model: Path, concurrency: int, max_tokens: int, rounds: int) -> dict[str, Any]:
    import torch

    from agentjet_server.engine import create_engine

    if kind == "waves":  # the transformers engine as it was: newcomers wait for the running batch
        from agentjet_server.engine.base import EngineOptions
        from agentjet_server.engine.hf import TransformersEngine

        engine: Any = TransformersEngine(model, EngineOptions(model_name="bench"), continuous=False)
    else:
        engine = create_engine(kind, model, model_name="bench", device="cpu", max_batch=64)  # type: ignore[arg-type]
    prompts = [engine.render([{"role": "user", "content": f"Tell me about item {i}."}]) for i in range(concurrency)]
    asyncio.run(_burst(engine, prompts[:2], 8, 0))  # warm-up
    tokens, seconds = 0, 0.0
    gaps: list[float] = []
    for r in range(rounds):
        n, s, stamps = asyncio.run(_burst(engine, prompts, max_tokens, 1000 * r))
        tokens, seconds = tokens + n, seconds + s
        gaps += [b - a for st in stamps for a, b in itertools.pairwise(st)]

    # three staggered runs (one is at the mercy of a noisy neighbour): median throughput, pooled first tokens
    runs = [asyncio.run(_staggered(engine, prompts, 48, 0.02)) for _ in range(3)]
    firsts = sorted(t for run in runs for t in run.pop("first"))
    staggered = {
        "stagger_tokens_per_s": statistics.median(run["stagger_tokens_per_s"] for run in runs),
        "ttft_p50_ms": firsts[len(firsts) // 2] * 1000,
        "ttft_p95_ms": firsts[int(len(firsts) * 0.95)] * 1000,
    }

    from transformers import AutoModelForCausalLM

    weights = {k: v + 0.01 for k, v in AutoModelForCausalLM.from_pretrained(model).state_dict().items()}
    update: dict[str, float] = {}

    def push() -> None:
        time.sleep(0.3)
        started = time.perf_counter()
        engine.update_weights(weights, 1)
        update["seconds"] = time.perf_counter() - started
        update["at"] = started

    thread = threading.Thread(target=push)
    thread.start()
    _, _, stamps = asyncio.run(_burst(engine, prompts, max_tokens * 4, 99))
    thread.join()
    end = update["at"] + update["seconds"]
    around = [b - a for st in stamps for a, b in itertools.pairwise(st) if a <= end and b >= update["at"]]
    in_flight = sum(1 for st in stamps if st and st[0] < update["at"] < st[-1])
    engine.close()
    return {
        "engine": kind,
        "threads": torch.get_num_threads(),
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "gap_p50_ms": statistics.median(gaps) * 1000,
        "gap_max_ms": max(gaps) * 1000,
        "update_ms": update["seconds"] * 1000,
        "update_in_flight": in_flight,
        "gap_across_update_ms": max(around) * 1000 if around else float("nan"),
        **staggered,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2, help="OMP/torch threads for both engines")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        result = measure(args.child, Path(args.model), args.concurrency, args.max_tokens, args.rounds)
        print("RESULT " + json.dumps(result))
        return
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(args.size, Path(tmp) / args.size)
        params = int((model / "params.txt").read_text())
        print(
            f"model: {args.size} ({params / 1e6:.2f}M parameters, fp32, CPU); {args.concurrency} concurrent "
            f"requests x {args.max_tokens} tokens x {args.rounds} rounds; {args.threads} threads each",
            flush=True,
        )
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        results = {}
        for kind in ENGINES:
            print(f"measuring {kind} ...", flush=True)
            cmd = [sys.executable, __file__, "--child", kind, "--model", str(model)]
            cmd += ["--concurrency", str(args.concurrency), "--max-tokens", str(args.max_tokens)]
            cmd += ["--rounds", str(args.rounds)]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if proc.returncode != 0 or line is None:
                sys.exit(f"{kind} run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
            results[kind] = json.loads(line.removeprefix("RESULT "))
    rows = [
        ("decode throughput (tokens/s)", "tokens_per_s", "{:.0f}"),
        ("inter-token gap p50 (ms)", "gap_p50_ms", "{:.1f}"),
        ("inter-token gap max (ms)", "gap_max_ms", "{:.1f}"),
        ("staggered arrivals: tokens/s", "stagger_tokens_per_s", "{:.0f}"),
        ("staggered arrivals: first token p50 (ms)", "ttft_p50_ms", "{:.1f}"),
        ("staggered arrivals: first token p95 (ms)", "ttft_p95_ms", "{:.1f}"),
        ("weight update, learner's wait (ms)", "update_ms", "{:.1f}"),
        ("requests in flight at the update", "update_in_flight", "{}"),
        ("longest gap across the update (ms)", "gap_across_update_ms", "{:.1f}"),
    ]
    waves, hf, vl = results["waves"], results["transformers"], results["vllm"]
    heads = ("transformers, waves", "transformers", "vLLM", "transformers / waves", "vLLM / transformers")
    print("\n| " + " | ".join([f"{'':42}", *(f"{h:>20}" for h in heads)]) + " |")
    print("|" + "|".join(["-" * 44, *("-" * 22 for _ in heads)]) + "|")
    for label, key, fmt in rows:
        cells = [fmt.format(r[key]) for r in (waves, hf, vl)]
        cells += [f"{a[key] / b[key]:.2f}" if b[key] else "nan" for a, b in ((hf, waves), (vl, hf))]
        print("| " + " | ".join([f"{label:42}", *(f"{c:>20}" for c in cells)]) + " |")


if __name__ == "__main__":
    main()
