"""Added latency of the server's chat endpoint and of the client capture paths.

Every path serves the same request (greedy, same prompt, same max_tokens, so the same tokens)
from the same embedded model; each is compared with calling the engine directly in-process.
Requests are sequential, so the figures are latencies, not throughput. Run:

    .venv/bin/python bench/latency.py [--requests 200]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import httpx2
import openai

from _server import served
from agentjet_client import SwarmClient

MESSAGES = [{"role": "user", "content": "Write seven as a digit."}]
MAX_TOKENS = 8


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def timed(fn: Callable[[], object], n: int, warm: int = 10) -> list[float]:
    for _ in range(warm):
        fn()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1000)
    return out


def engine_direct(model_dir: Path, n: int) -> list[float]:
    from agentjet_server.engine.base import SamplingParams
    from agentjet_server.engine.hf import TransformersEngine

    engine = TransformersEngine(model_dir)
    loop = asyncio.new_event_loop()

    async def once() -> None:
        ids = engine.render(MESSAGES)
        async for _ in engine.generate(ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)):
            pass

    try:
        return timed(lambda: loop.run_until_complete(once()), n)
    finally:
        loop.close()
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200)
    args = parser.parse_args()
    from agentjet_server.embedded import ensure_embedded_model

    model_dir = ensure_embedded_model()
    n = args.requests
    results: dict[str, list[float]] = {}
    print(f"engine direct: {n} requests ...", flush=True)
    results["engine direct (in-process)"] = engine_direct(model_dir, n)

    with served(model_dir) as url:
        body = {"model": "agentjet-tiny", "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0.0}
        with httpx2.Client() as http:
            print("server endpoint (raw HTTP) ...", flush=True)
            results["server /v1/chat/completions (raw HTTP)"] = timed(
                lambda: http.post(url + "/v1/chat/completions", json=body).raise_for_status(), n
            )
        with openai.OpenAI(base_url=url + "/v1", api_key="x") as sdk:
            print("OpenAI SDK, no capture ...", flush=True)
            results["OpenAI SDK, no capture"] = timed(lambda: sdk.chat.completions.create(**body), n)
        with SwarmClient(url) as client:
            episode = client.episode("bench")
            sdk = episode.openai()
            print("OpenAI SDK through episode.openai() capture ...", flush=True)
            results["OpenAI SDK via episode.openai() (capture transport)"] = timed(
                lambda: sdk.chat.completions.create(**body), n
            )
            proxy_sdk = openai.OpenAI(base_url=episode.base_url, api_key="x")
            print("OpenAI SDK through the loopback capture proxy ...", flush=True)
            results["OpenAI SDK via capture proxy (episode.base_url)"] = timed(
                lambda: proxy_sdk.chat.completions.create(**body), n
            )
            proxy_sdk.close()
            assert len(episode.recorder.turns) == 2 * (n + 10) and episode.recorder.failures == 0
            episode.close()

    base50 = statistics.median(results["engine direct (in-process)"])
    base99 = pct(results["engine direct (in-process)"], 0.99)
    print(f"\n{n} sequential greedy requests, {MAX_TOKENS} max tokens, embedded model, CPU")
    print(f"{'path':<55} {'p50 ms':>8} {'p99 ms':>8} {'p50 x':>7} {'p99 x':>7} {'+p50 ms':>8}")
    for name, values in results.items():
        p50, p99 = statistics.median(values), pct(values, 0.99)
        print(f"{name:<55} {p50:8.2f} {p99:8.2f} {p50 / base50:7.2f} {p99 / base99:7.2f} {p50 - base50:8.2f}")


if __name__ == "__main__":
    main()
