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
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
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

    print("metrics on and off: two servers, requests alternating in blocks of 20 ...", flush=True)
    on, off = metrics_on_off(model_dir, n)
    results["server, metrics on (/metrics scraped every 2 s)"] = on
    results["server, metrics off (--no-metrics)"] = off
    print("tracing on and off: two servers, traced and untraced requests alternating in blocks of 20 ...", flush=True)
    results.update(tracing_on_off(model_dir, n))
    print("learning paused, with batches waiting, against idle and training ...", flush=True)
    results.update(paused_and_training(model_dir, n))

    base50 = statistics.median(results["engine direct (in-process)"])
    base99 = pct(results["engine direct (in-process)"], 0.99)
    print(f"\n{n} sequential greedy requests, {MAX_TOKENS} max tokens, embedded model, CPU")
    print(f"{'path':<62} {'p50 ms':>8} {'p99 ms':>8} {'p50 x':>7} {'p99 x':>7} {'+p50 ms':>8}")
    for name, values in results.items():
        p50, p99 = statistics.median(values), pct(values, 0.99)
        print(f"{name:<62} {p50:8.2f} {p99:8.2f} {p50 / base50:7.2f} {p99 / base99:7.2f} {p50 - base50:8.2f}")
    ratio = statistics.median(on) / statistics.median(off)
    print(f"\nchat p50 with metrics on / off: {ratio:.3f} (target <= 1.05)")
    on, off, traced, untraced = (statistics.median(results[name]) for name in TRACING_ROWS)
    print(f"server chat p50 with tracing on / off: {on / off:.3f} (target <= 1.05)")
    print(f"episode chat p50, client and server traced / not: {traced / untraced:.3f}")
    idle = statistics.median(results["server idle (nothing to train)"])
    paused = statistics.median(results["server paused, 8 batches waiting"])
    print(f"chat p50 paused with batches waiting / idle: {paused / idle:.3f}")


def metrics_on_off(model_dir: Path, n: int, block: int = 20) -> tuple[list[float], list[float]]:
    """Chat latency of two servers, one counting metrics (and scraped), one with ``--no-metrics``,
    measured in alternating blocks so that drift of the machine falls on both alike."""
    body = {"model": "agentjet-tiny", "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0.0}
    on: list[float] = []
    off: list[float] = []
    stop = threading.Event()
    with served(model_dir) as url_on, served(model_dir, "--no-metrics") as url_off, httpx2.Client() as http:

        def scrape() -> None:
            while not stop.wait(2.0):
                http_scrape.get(url_on + "/metrics").raise_for_status()

        http_scrape = httpx2.Client()
        scraper = threading.Thread(target=scrape, daemon=True)
        scraper.start()
        try:
            for url in (url_on, url_off):  # warm both
                for _ in range(10):
                    http.post(url + "/v1/chat/completions", json=body).raise_for_status()
            while len(on) < n:
                for url, out in ((url_on, on), (url_off, off)):
                    out += timed(
                        lambda u=url: http.post(u + "/v1/chat/completions", json=body).raise_for_status(), block, warm=0
                    )
        finally:
            stop.set()
            scraper.join(timeout=5)
            http_scrape.close()
    return on[:n], off[:n]


class _Collector(BaseHTTPRequestHandler):
    """An OTLP/HTTP endpoint that takes every export (what a collector's receiver does first)."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def tracing_on_off(model_dir: Path, n: int, block: int = 20) -> dict[str, list[float]]:
    """Chat latency with tracing on and off, in alternating blocks so that drift of the machine falls on all alike:
    the server's chat path (a server exporting its spans over OTLP to a local endpoint, each request carrying a
    client's trace context, against a server without tracing and requests without it), and the whole episode
    path (a traced client's ``episode.openai()``: episode and call spans exported too, against an untraced one)."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from agentjet_client import tracing

    collector = ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{collector.server_address[1]}"
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint + "/v1/traces")))
    body = {"model": "agentjet-tiny", "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0.0}
    context = {
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "baggage": "agentjet.episode=e1",
    }
    out: dict[str, list[float]] = {name: [] for name in TRACING_ROWS}
    try:
        with (
            served(model_dir, env={"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint}) as url_on,
            served(model_dir) as url_off,
            SwarmClient(url_on) as client_on,
            SwarmClient(url_off) as client_off,
            httpx2.Client() as http,
        ):
            for _ in range(n // block + 1):  # the first block of each is warming, dropped below
                for name, url, headers in ((TRACING_ROWS[0], url_on, context), (TRACING_ROWS[1], url_off, {})):
                    post = lambda u=url, h=headers: http.post(u + "/v1/chat/completions", json=body, headers=h)  # noqa: E731
                    out[name] += timed(lambda post=post: post().raise_for_status(), block, warm=0)
                for name, client, traced in ((TRACING_ROWS[2], client_on, True), (TRACING_ROWS[3], client_off, False)):
                    tracing.use_provider(provider if traced else None)
                    episode = client.episode("bench")
                    sdk = episode.openai()
                    out[name] += timed(lambda sdk=sdk: sdk.chat.completions.create(**body), block, warm=0)
                    episode.close()
    finally:
        tracing.use_provider(None)
        provider.shutdown()
        collector.shutdown()
    return {name: values[block : n + block] for name, values in out.items()}


TRACING_ROWS = (
    "server chat, tracing on (spans over OTLP)",
    "server chat, tracing off",
    "episode chat, client and server traced",
    "episode chat, not traced",
)


def paused_and_training(model_dir: Path, n: int) -> dict[str, list[float]]:
    """Chat latency of one server: idle; learning paused with eight batches waiting; then learning
    (resumed: the learner trains those batches on the same CPUs)."""
    body = {"model": "agentjet-tiny", "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0.0}
    out: dict[str, list[float]] = {}
    with served(model_dir, "--batch-groups", "1", "--group-size", "8") as url, httpx2.Client(timeout=120) as http:
        post = lambda: http.post(url + "/v1/chat/completions", json=body).raise_for_status()  # noqa: E731
        out["server idle (nothing to train)"] = timed(post, n)
        http.post(url + "/v1/admin/pause").raise_for_status()
        with SwarmClient(url) as client:
            batch = []
            for group in range(8):
                for k in range(8):
                    episode = client.episode(f"bench-{group}")
                    episode.openai().chat.completions.create(
                        model="agentjet-tiny", messages=MESSAGES, max_tokens=4, temperature=1.0
                    )
                    episode.close()
                    batch.append(episode.to_trajectory(float(k % 2)))
            client.submit(batch)
        status = http.get(url + "/v1/status").json()
        assert status["paused"] and status["trajectories"]["buffered"] == 64 and status["learner"]["step"] == 0
        out["server paused, 8 batches waiting"] = timed(post, n)
        assert http.get(url + "/v1/status").json()["learner"]["step"] == 0  # no step while paused
        http.post(url + "/v1/admin/resume").raise_for_status()
        out["server learning (those 8 batches, same CPUs)"] = timed(post, min(n, 60), warm=0)
    return out


if __name__ == "__main__":
    main()
