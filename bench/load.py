"""Many clients at once against one server, then ingestion alone.

    python bench/load.py [--clients 200] [--seconds 120] [--ingest-seconds 15]

1. **Load**: one real ``agentjet-server up`` (embedded model, learner on). ``--clients`` simulated
   clients (asyncio, one HTTP connection pool) each loop until the deadline: a chat completion on
   a demo prompt, then the trajectory built from that response (its tokens, log-probs, versions and
   signature, rewarded for the right digit), pushed alone with ``POST /v1/trajectories``. A push
   answered 429 (the server's backpressure) waits ``Retry-After`` and is sent again, as the client
   package does. Reported: chat and push requests per second, latency p50/p99 of each, errors (any
   other failure), the server's RSS after warm-up (a fifth of the run), at the middle and at the end,
   and, after the server stops, every trajectory it acknowledged looked up in its write-ahead log.
2. **Ingestion alone**: a fresh server with learning paused and a buffer large enough for the run;
   a few pushers send batches of 64 trajectories of 2,048 tokens each (1,536 prompt, 512 sampled,
   unsigned), every batch fsynced by the server before it answers. Reported: trajectories/s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2

from _server import wait_until_up
from agentjet_server.embedded import NUMBER_WORDS, ensure_embedded_model

GROUP = 16


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


@contextlib.contextmanager
def server(state: Path, *extra: str) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [str(Path(sys.executable).parent / "agentjet-server"), "up", "--port", str(port)]
    command += ["--model", str(ensure_embedded_model()), "--model-name", "agentjet-tiny"]
    command += ["--log-level", "warning", "--state-dir", str(state), *extra]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(url)
        yield url, process
    finally:
        process.terminate()
        process.wait(timeout=60)


def logged_ids(state: Path) -> set[str]:
    from agentjet_server.ingest.wal import Accepted, read_records

    return {r.id for r in read_records(state / "log", compacted=True) if isinstance(r, Accepted)}


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) >= 2 else float("nan")


# -- 1. load ---------------------------------------------------------------------------------------


async def load(url: str, pid: int, clients: int, seconds: float) -> dict[str, Any]:
    counter = iter(range(10**9))
    chat_ms: list[float] = []
    push_ms: list[float] = []
    errors: Counter[str] = Counter()
    acknowledged: set[str] = set()
    backpressure = 0
    deadline = time.monotonic() + seconds
    samples: dict[str, int] = {}

    async def one(http: httpx2.AsyncClient) -> None:
        nonlocal backpressure
        while time.monotonic() < deadline:
            k = next(counter)
            group = k // GROUP
            digit = group % 10
            messages = [{"role": "user", "content": f"Write {NUMBER_WORDS[digit]} as a digit."}]
            started = time.perf_counter()
            try:
                r = await http.post(
                    "/v1/chat/completions",
                    json={"model": "agentjet-tiny", "messages": messages, "max_tokens": 4, "temperature": 1.0},
                )
            except httpx2.HTTPError as exc:
                errors[f"chat {type(exc).__name__}"] += 1
                continue
            chat_ms.append((time.perf_counter() - started) * 1000)
            if r.status_code != 200:
                errors[f"chat {r.status_code}"] += 1
                continue
            choice = r.json()["choices"][0]
            ext = choice["agentjet"]
            turn = {
                "policy_version": ext["policy_version"],
                "prompt_token_ids": ext["prompt_token_ids"],
                "completion_token_ids": ext["completion_token_ids"],
                "completion_logprobs": ext["completion_logprobs"],
                "completion_versions": ext["completion_versions"],
                "finish_reason": ext["finish_reason"],
                "signature": ext.get("signature"),
            }
            tid = uuid.uuid4().hex
            reward = float((choice["message"]["content"] or "").strip() == str(digit))
            body = {"trajectories": [{"id": tid, "task_id": f"g{group}", "turns": [turn], "reward": reward}]}
            while True:
                started = time.perf_counter()
                try:
                    r = await http.post("/v1/trajectories", json=body)
                except httpx2.HTTPError as exc:
                    errors[f"push {type(exc).__name__}"] += 1
                    await asyncio.sleep(0.5)
                    continue  # a push that got no answer is sent again (the id makes it idempotent)
                push_ms.append((time.perf_counter() - started) * 1000)
                if r.status_code == 429:
                    backpressure += 1
                    await asyncio.sleep(float(r.headers.get("Retry-After", "1")))
                    continue
                if r.status_code != 200:
                    errors[f"push {r.status_code}"] += 1
                    break
                result = r.json()["results"][0]
                if result["status"] in ("accepted", "duplicate"):
                    acknowledged.add(tid)
                else:
                    errors[f"push {result['status']}: {result.get('reason')}"] += 1
                break

    async def sample() -> None:
        for name, at in (("warm", 0.2), ("middle", 0.5), ("end", 0.98)):
            await asyncio.sleep(max(0.0, deadline - seconds * (1 - at) - time.monotonic()))
            samples[name] = rss(pid)

    limits = httpx2.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
    async with httpx2.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        samples["start"] = rss(pid)
        started = time.monotonic()
        await asyncio.gather(sample(), *(one(http) for _ in range(clients)))
        took = time.monotonic() - started
        status = (await http.get("/v1/status")).json()
    return {
        "seconds": took,
        "chat": chat_ms,
        "push": push_ms,
        "errors": errors,
        "acknowledged": acknowledged,
        "backpressure": backpressure,
        "rss": samples,
        "steps": status["learner"]["step"],
    }


# -- 2. ingestion alone ----------------------------------------------------------------------------


def batch_body(n: int, seed: int) -> dict[str, Any]:
    import random

    rng = random.Random(seed)
    prompt = [rng.randrange(5, 1000) for _ in range(1536)]
    items = []
    for _ in range(n):
        items.append(
            {
                "id": uuid.uuid4().hex,
                "task_id": f"t{rng.randrange(10**6)}",
                "turns": [
                    {
                        "policy_version": 0,
                        "prompt_token_ids": prompt,
                        "completion_token_ids": [rng.randrange(5, 1000) for _ in range(512)],
                        "completion_logprobs": [-rng.random() * 5 for _ in range(512)],
                        "finish_reason": "length",
                    }
                ],
                "reward": rng.random(),
            }
        )
    return {"trajectories": items}


async def ingest(url: str, seconds: float, pushers: int, size: int) -> tuple[int, float, Counter[str]]:
    """Push pre-encoded batches (fresh ids spliced in) so the pushers' own JSON encoding does not
    take the server's CPU: what is measured is the server's ingestion."""
    import json
    import re

    slot = re.compile(rb"@ID@[0-9]{28}")
    templates = []
    for s in range(8):
        body = batch_body(size, s)
        for i, item in enumerate(body["trajectories"]):
            item["id"] = f"@ID@{i:028d}"  # as long as a uuid4 hex
        templates.append(json.dumps(body).encode())
    accepted = 0
    errors: Counter[str] = Counter()
    deadline = time.monotonic() + seconds

    async def pusher(http: httpx2.AsyncClient, index: int) -> None:
        nonlocal accepted
        k = index
        while time.monotonic() < deadline:
            data = slot.sub(lambda _m: uuid.uuid4().hex.encode(), templates[k % len(templates)])
            k += pushers
            r = await http.post("/v1/trajectories", content=data, headers={"content-type": "application/json"})
            if r.status_code != 200:
                errors[str(r.status_code)] += 1
                await asyncio.sleep(0.2)
                continue
            accepted += sum(x["status"] == "accepted" for x in r.json()["results"])

    async with httpx2.AsyncClient(base_url=url, timeout=120) as http:
        await http.post("/v1/admin/pause")
        started = time.monotonic()
        await asyncio.gather(*(pusher(http, i) for i in range(pushers)))
        return accepted, time.monotonic() - started, errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--ingest-seconds", type=float, default=15.0)
    parser.add_argument("--pushers", type=int, default=4)
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="agentjet-load-"))
    try:
        print(f"1. load: {args.clients} clients for {args.seconds:.0f} s ...", flush=True)
        state = root / "load"
        with server(state) as (url, process):
            time.sleep(2)
            out = asyncio.run(load(url, process.pid, args.clients, args.seconds))
        logged = logged_ids(state)
        missing = out["acknowledged"] - logged
        chat, push, rss_mb = out["chat"], out["push"], {k: v / 2**20 for k, v in out["rss"].items()}
        growth = (rss_mb["end"] - rss_mb["warm"]) / rss_mb["warm"]
        print(f"| {args.clients} clients, {out['seconds']:.0f} s | value |")
        print("|---|---|")
        print(f"| chat completions/s | {len(chat) / out['seconds']:.1f} |")
        print(f"| chat latency p50 / p99 (ms) | {pct(chat, 50):.0f} / {pct(chat, 99):.0f} |")
        print(f"| trajectory pushes/s (429 retries included) | {len(push) / out['seconds']:.1f} |")
        print(f"| push latency p50 / p99 (ms) | {pct(push, 50):.0f} / {pct(push, 99):.0f} |")
        print(f"| pushes answered 429 (then retried) | {out['backpressure']} |")
        print(f"| errors | {sum(out['errors'].values())} {dict(out['errors']) or ''} |")
        print(f"| learner steps during the run | {out['steps']} |")
        print(
            f"| server RSS start / after warm-up / middle / end (MiB) | {rss_mb['start']:.0f} / {rss_mb['warm']:.0f}"
            f" / {rss_mb['middle']:.0f} / {rss_mb['end']:.0f} |"
        )
        print(f"| RSS growth after warm-up | {growth:+.1%} |")
        print(
            f"| acknowledged trajectories / found in the log / missing | {len(out['acknowledged'])} / "
            f"{len(out['acknowledged'] & logged)} / {len(missing)} |"
        )

        print(f"\n2. ingestion alone: {args.pushers} pushers, batches of 64 x 2,048-token trajectories ...", flush=True)
        state = root / "ingest"
        extra = ("--max-buffered", "1000000")
        with server(state, *extra) as (url, _process):
            accepted, took, errors = asyncio.run(ingest(url, args.ingest_seconds, args.pushers, 64))
        print("| ingestion | value |")
        print("|---|---|")
        print(f"| trajectories accepted (2,048 tokens each) | {accepted} in {took:.1f} s |")
        print(f"| trajectories/s | {accepted / took:.0f} |")
        print(f"| errors | {sum(errors.values())} {dict(errors) or ''} |")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
