"""The Tinker API against AgentJet's native paths on the same work, side by side in one run.

    python bench/tinker_api.py [--steps 20] [--examples 32] [--samples 64] [--json FILE]

One ``agentjet-server up --lora-rank 16`` (the embedded tiny model). Training: the same chats, rendered with
the model's chat template into the same tokens and trained positions (``learner.supervised``), one update per
step at the same learning rate on a rank-16 adapter: (a) ``POST /v1/train/sft`` (the learner's own LoRA) and
(b) the Tinker SDK's ``forward_backward`` + ``optim_step`` on a rank-16 training client (the workbench).
Sampling: the same prompt, ``--samples`` completions of exactly 32 tokens each (no end-of-sequence stop),
eight requests in flight: (c) ``/v1/completions`` (the engine, continuously batched) and (d) the SDK's
``sample`` (the workbench, one request at a time). Reported: trained tokens per second, sampled tokens per
second, and the ratios Tinker / native.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import httpx2

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._server import served  # noqa: E402

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
TOKENS = 32


def chats(n: int) -> list[dict]:  # type: ignore[type-arg]
    return [
        {
            "messages": [
                {"role": "user", "content": f"Write {WORDS[i % 10]} as a digit, then {WORDS[(i * 3) % 10]}."},
                {"role": "assistant", "content": f"{i % 10} then {(i * 3) % 10}"},
            ]
        }
        for i in range(n)
    ]


def tinker_data(model_dir: Path, examples: list[dict]) -> tuple[list, int]:  # type: ignore[type-arg]
    """The chats as Tinker datums with the tokens and trained positions the native SFT path makes."""
    from tinker import types

    from agentjet_server.engine.tokens import ChatTokenizer
    from agentjet_server.learner.supervised import examples_batch

    batch = examples_batch(ChatTokenizer(model_dir), examples)
    data, trained = [], 0
    for seq in batch.sequences:
        weights = [0.0] * (len(seq.tokens) - 1)
        for p in seq.positions:
            weights[p - 1] = 1.0
        trained += len(seq.positions)
        inputs = {"target_tokens": seq.tokens[1:], "weights": weights}
        data.append(types.Datum(model_input=types.ModelInput.from_ints(seq.tokens[:-1]), loss_fn_inputs=inputs))
    return data, trained


def native_training(url: str, examples: list[dict], steps: int, lr: float) -> tuple[float, float, float]:  # type: ignore[type-arg]
    headers = {"Authorization": "Bearer admin-bench-key"}

    def post() -> httpx2.Response:
        return httpx2.post(url + "/v1/train/sft", json={"examples": examples, "lr": lr}, headers=headers, timeout=600)

    first = post().json()
    start = time.perf_counter()
    for _ in range(steps):
        last = post().json()
    return time.perf_counter() - start, first["loss"], last["loss"]


def tinker_training(service, data: list, steps: int, lr: float, trained: int) -> tuple[float, float, float]:  # type: ignore[no-untyped-def,type-arg]
    from tinker import types

    client = service.create_lora_training_client(base_model="agentjet-tiny", rank=16, seed=0).result()

    def step() -> float:
        out = client.forward_backward(data, "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=lr, beta2=0.999, eps=1e-8)).result()
        return out.metrics["loss:sum"] / trained

    first = step()
    start = time.perf_counter()
    for _ in range(steps):
        last = step()
    return time.perf_counter() - start, first, last


async def native_sampling(url: str, prompt: str, samples: int) -> float:
    body = {"model": "agentjet-tiny", "prompt": prompt, "max_tokens": TOKENS, "ignore_eos": True, "temperature": 1.0}
    headers = {"Authorization": "Bearer admin-bench-key"}
    async with httpx2.AsyncClient(timeout=600) as client:
        gate = asyncio.Semaphore(8)

        async def one() -> int:
            async with gate:
                answer = (await client.post(url + "/v1/completions", json=body, headers=headers)).json()
                return int(answer["usage"]["completion_tokens"])

        start = time.perf_counter()
        counts = await asyncio.gather(*(one() for _ in range(samples)))
    assert set(counts) == {TOKENS}, counts
    return time.perf_counter() - start


async def tinker_sampling(sampler, prompt_ids: list[int], samples: int) -> float:  # type: ignore[no-untyped-def]
    from tinker import types

    params = types.SamplingParams(max_tokens=TOKENS, temperature=1.0, stop=[])
    gate = asyncio.Semaphore(8)

    async def one() -> int:
        async with gate:
            answer = await sampler.sample(types.ModelInput.from_ints(prompt_ids), 1, params)
            return len(answer.sequences[0].tokens)

    start = time.perf_counter()
    counts = await asyncio.gather(*(one() for _ in range(samples)))
    assert set(counts) == {TOKENS}, counts
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--examples", type=int, default=32)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    import tinker

    from agentjet_server.embedded import ensure_embedded_model

    model_dir = ensure_embedded_model()
    examples = chats(args.examples)
    data, trained = tinker_data(model_dir, examples)
    prompt = "Write seven as a digit, then three."
    env = {"AGENTJET_ADMIN_KEYS": "admin-bench-key"}
    with served(model_dir, "--lora-rank", "16", "--log-level", "warning", env=env) as url:
        print(f"training: {args.examples} chats ({trained} trained tokens), {args.steps} steps each", flush=True)
        native_s, native_first, native_last = native_training(url, examples, args.steps, args.lr)
        print(f"  native /v1/train/sft  {native_s:6.2f} s  loss {native_first:.3f} -> {native_last:.3f}", flush=True)
        with tinker.ServiceClient(base_url=url, api_key="tml-admin-bench-key") as service:
            tinker_s, tinker_first, tinker_last = tinker_training(service, data, args.steps, args.lr, trained)
            print(
                f"  tinker fwd_bwd+optim   {tinker_s:6.2f} s  loss {tinker_first:.3f} -> {tinker_last:.3f}", flush=True
            )
            print(f"sampling: {args.samples} completions of {TOKENS} tokens, 8 in flight", flush=True)
            native_sample_s = asyncio.run(native_sampling(url, prompt, args.samples))
            print(f"  native /v1/completions {native_sample_s:6.2f} s", flush=True)
            sampler = service.create_sampling_client(base_model="agentjet-tiny").result()
            # a sampling client's get_tokenizer looks the base model's name up on the hub (docs/tinker.md)
            from transformers import AutoTokenizer

            prompt_ids = AutoTokenizer.from_pretrained(str(model_dir)).encode(prompt)
            tinker_sample_s = asyncio.run(tinker_sampling(sampler, prompt_ids, args.samples))
            print(f"  tinker sample          {tinker_sample_s:6.2f} s", flush=True)
    tokens = args.samples * TOKENS
    result = {
        "trained_tokens_per_s": {"native": trained * args.steps / native_s, "tinker": trained * args.steps / tinker_s},
        "sampled_tokens_per_s": {"native": tokens / native_sample_s, "tinker": tokens / tinker_sample_s},
        "loss": {"native": [native_first, native_last], "tinker": [tinker_first, tinker_last]},
    }
    result["ratio_training"] = result["trained_tokens_per_s"]["tinker"] / result["trained_tokens_per_s"]["native"]
    result["ratio_sampling"] = result["sampled_tokens_per_s"]["tinker"] / result["sampled_tokens_per_s"]["native"]
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
