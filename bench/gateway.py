"""Latency the gateway adds over calling the server directly, at 1 and at 64 concurrent sessions.

One ``agentjet-server up`` (the embedded model) and one ``agentjet-client gateway`` in front of it, real
processes on loopback. Each round sends the same request (greedy, the same prompt and max_tokens, so
the same tokens) straight to the server and through the gateway, alternating block by block so both
paths see the same machine load; each call through the gateway is a session of its own, captured and
journaled before its answer is released. Reported: p50 and p99 of each path and of the difference, and the
gateway process's CPU (all its threads) per call through it.

    .venv/bin/python bench/gateway.py [--requests 400] [--concurrency 1,64]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx2

from _server import served, wait_until_up

MESSAGES = [{"role": "user", "content": "Write seven as a digit."}]
BODY = {"model": "agentjet-tiny", "messages": MESSAGES, "max_tokens": 4, "temperature": 0.0}


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def block(base: str, sessions: int, requests: int, gateway: bool) -> list[float]:
    """``requests`` calls, ``sessions`` at a time; each call's latency in seconds."""
    latencies: list[float] = []
    limits = httpx2.Limits(max_connections=sessions + 8)
    async with httpx2.AsyncClient(base_url=base, timeout=120, limits=limits) as http:
        queue = list(range(requests))

        async def user() -> None:
            while queue:
                queue.pop()
                headers = {"X-AgentJet-Session": uuid.uuid4().hex} if gateway else {}
                started = time.perf_counter()
                reply = await http.post("/v1/chat/completions", json=BODY, headers=headers)
                latencies.append(time.perf_counter() - started)
                assert reply.status_code == 200, reply.text

        await asyncio.gather(*(user() for _ in range(sessions)))
    return latencies


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def gateway_process(server: str, spool: Path) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = str(Path(sys.executable).parent / "agentjet-client")
    command = [exe, "gateway", "--server", server, "--port", str(port), "--spool-dir", str(spool)]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ})
    url = f"http://127.0.0.1:{port}"
    wait_until_up(url)
    return proc, url


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=400, help="calls per path and concurrency")
    parser.add_argument("--concurrency", default="1,64", help="sessions at once, comma-separated")
    parser.add_argument("--blocks", type=int, default=4, help="alternations of the two paths")
    args = parser.parse_args()
    from agentjet_server.embedded import ensure_embedded_model

    model_dir = ensure_embedded_model()
    rows = []
    with served(model_dir, "--serve-only") as server, tempfile.TemporaryDirectory() as spool:
        proc, gateway = gateway_process(server, Path(spool))
        try:
            for sessions in [int(x) for x in args.concurrency.split(",")]:
                asyncio.run(block(server, sessions, 2 * sessions, False))  # warm both paths
                asyncio.run(block(gateway, sessions, 2 * sessions, True))
                direct: list[float] = []
                through: list[float] = []
                cpu = 0.0
                per_block = max(sessions, args.requests // args.blocks)
                for _ in range(args.blocks):
                    direct += asyncio.run(block(server, sessions, per_block, False))
                    before = cpu_s(proc.pid)
                    through += asyncio.run(block(gateway, sessions, per_block, True))
                    cpu += cpu_s(proc.pid) - before
                rows.append((sessions, direct, through, cpu / len(through)))
                print(f"{sessions} at once: {len(direct)} calls each path", flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    print()
    print(
        "| sessions at once | direct p50 | gateway p50 | gateway / direct p50 | direct p99 | gateway p99 "
        "| gateway CPU a call |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for sessions, direct, through, cpu in rows:
        d50, g50, d99, g99 = pct(direct, 0.5), pct(through, 0.5), pct(direct, 0.99), pct(through, 0.99)
        print(
            f"| {sessions} | {d50 * 1e3:.1f} ms | {g50 * 1e3:.1f} ms | {g50 / d50:.2f}x | "
            f"{d99 * 1e3:.1f} ms | {g99 * 1e3:.1f} ms | {cpu * 1e3:.2f} ms |"
        )


if __name__ == "__main__":
    main()
