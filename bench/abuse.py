"""Abuse: does one hostile client stall the server or eat its memory?

One real ``agentjet-server up`` process (embedded model), started with an open-file limit of
1,024 (soft and hard, so it can't raise it). For each scenario, attackers run for a while in
threads while two probes measure what everyone else sees: ``GET /healthz`` every 20 ms and an
ordinary chat request (8 tokens) back to back. Before the scenarios the same probes run against
the idle server: that is the baseline each row is compared with, in the same run. Reported per
scenario: /healthz p50/p99, the chat request's p99, probe failures, the server's RSS growth over
its RSS before the scenario, and what the attackers were answered.

    .venv/bin/python bench/abuse.py [--seconds 12]

Goal (issue 11): /healthz p99 under 100 ms and RSS growth under 200 MB in every scenario.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx2

from _server import wait_until_up
from agentjet_server.embedded import ensure_embedded_model

Attack = Callable[[str, int, threading.Event, Counter[str]], None]


def rss_mb(pid: int) -> float:
    """The server's resident memory, its helper processes (the body gate) included."""
    total = 0.0
    children = Path(f"/proc/{pid}/task/{pid}/children")
    for each in [pid, *(int(c) for c in children.read_text().split())] if children.exists() else [pid]:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{each}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) / 1024
    return total


@contextlib.contextmanager
def server(model: Path) -> Iterator[tuple[str, int, subprocess.Popen[bytes]]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    state = tempfile.mkdtemp(prefix="agentjet-abuse-")
    command = [str(Path(sys.executable).parent / "agentjet-server"), "up", "--port", str(port), "--model", str(model)]
    command += ["--model-name", "agentjet-tiny", "--state-dir", state, "--log-level", "warning"]

    def limit_files() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))

    log = open(Path(state) / "server.log", "wb")
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, preexec_fn=limit_files)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(url)
        yield url, port, proc
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()
        size = (Path(state) / "server.log").stat().st_size
        print(f"server log: {size / 1024:.0f} KiB in all scenarios")


# -- attackers -------------------------------------------------------------------------------------------


def post_raw(port: int, path: str, body: bytes, answers: Counter[str], read: bool = True) -> None:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
            head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            sock.sendall(head.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            if read:
                answer = sock.recv(64)
                answers[answer[9:12].decode() or "closed"] += 1
    except OSError as exc:
        answers[type(exc).__name__] += 1


def huge_bodies(url: str, port: int, stop: threading.Event, answers: Counter[str]) -> None:
    ints = json.dumps({"trajectories": list(range(1_400_000))}).encode()  # ~11 MB: parsed, then refused
    message = json.dumps({"messages": [{"role": "user", "content": "x" * 15_000_000}]}).encode()
    near_limit = json.dumps({"messages": [{"role": "user", "content": "word " * 800_000}]}).encode()  # ~4 MB
    while not stop.is_set():
        for path, body in (
            ("/v1/trajectories", ints),
            ("/v1/chat/completions", message),
            ("/v1/chat/completions", near_limit),
        ):
            post_raw(port, path, body, answers)


def error_bombs(url: str, port: int, stop: threading.Event, answers: Counter[str]) -> None:
    broken = json.dumps({"trajectories": [{"id": "x", "task_id": "t", "turns": [{}] * 512}] * 1024}).encode()
    ids = {"policy_version": 0, "prompt_token_ids": ["1"] * 900_000, "completion_token_ids": [1]}
    strings = json.dumps({"trajectories": [{"id": "y", "task_id": "t", "turns": [ids]}]}).encode()
    messages = json.dumps({"messages": [{"role": "robot", "content": 5}] * 4096}).encode()
    while not stop.is_set():
        for path, body in (
            ("/v1/trajectories", broken),
            ("/v1/trajectories", strings),
            ("/v1/chat/completions", messages),
        ):
            post_raw(port, path, body, answers)


def huge_sampling(url: str, port: int, stop: threading.Event, answers: Counter[str]) -> None:
    ask = [{"role": "user", "content": "Write a long story."}]
    asks = [
        {"messages": ask, "n": 64, "max_tokens": 10**9},  # past the context: 400 at once
        {"messages": ask, "n": 64, "max_tokens": 1000, "logprobs": True, "top_logprobs": 20},  # over the budget
        {"messages": ask, "n": 16, "max_tokens": 900, "logprobs": True},  # allowed: a real load
    ]
    with httpx2.Client(base_url=url, timeout=600) as client:
        while not stop.is_set():
            for body in asks:
                r = client.post("/v1/chat/completions", json=body)
                answers[
                    f"{r.status_code} ({len(r.content) >> 10} KiB)" if r.status_code == 200 else str(r.status_code)
                ] += 1
                if stop.is_set():
                    return


def idle_connections(url: str, port: int, stop: threading.Event, answers: Counter[str], reopen: bool = False) -> None:
    """1,100 connections that send nothing, or headers that never end; with ``reopen``, each one the
    server closes is opened again a second later (a flood of a few hundred connections a second)."""
    held: list[socket.socket] = []
    opened_once = False
    while not stop.is_set():
        alive = [s for s in held if not _closed(s)]
        for sock in set(held) - set(alive):
            sock.close()
        answers["closed by server"] += len(held) - len(alive)
        held = alive
        while len(held) < 1100 and not stop.is_set() and (reopen or not opened_once):
            try:
                sock = socket.create_connection(("127.0.0.1", port), timeout=5)
                if len(held) % 2:
                    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # headers that never end
                held.append(sock)
                answers["opened"] += 1
            except OSError as exc:
                answers[type(exc).__name__] += 1
                break
        opened_once = True
        stop.wait(1.0)
    for sock in held:
        sock.close()


def _closed(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        sock.setblocking(True)


def unread_streams(url: str, port: int, stop: threading.Event, answers: Counter[str]) -> None:
    body = json.dumps(
        {
            "messages": [{"role": "user", "content": "Go on."}],
            "stream": True,
            "max_tokens": 900,
            "n": 8,
            "logprobs": True,
        }
    ).encode()
    held = []
    while not stop.is_set():
        if len(held) < 64:
            sock = socket.create_connection(("127.0.0.1", port))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            head = "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            head += f"Content-Length: {len(body)}\r\n\r\n"
            sock.sendall(head.encode() + body)  # and never read the answer
            held.append(sock)
            answers["streams opened, never read"] += 1
        stop.wait(0.2)
    for sock in held:
        sock.close()


SCENARIOS: dict[str, tuple[Attack, int]] = {
    "huge bodies (11 MB of ints, 15 MB message, 4 MB near the limit)": (huge_bodies, 4),
    "error bombs (1024x512 broken turns, 900k string ids, 4096 bad messages)": (error_bombs, 4),
    "n=64 x max_tokens 1e9 / top_logprobs 20 / n=16 x 900 tokens": (huge_sampling, 4),
    "1,100 idle and slow-header connections at an open-file limit of 1,024": (idle_connections, 1),
    "the same, each one closed opened again 1 s later (~300 new connections/s)": (
        functools.partial(idle_connections, reopen=True),
        1,
    ),
    "64 streams (n=8, 900 tokens, logprobs) never read": (unread_streams, 1),
}


# -- probes ----------------------------------------------------------------------------------------------


def probe(url: str, pid: int, seconds: float, attack: Attack | None, workers: int, port: int) -> dict[str, object]:
    stop = threading.Event()
    answers: Counter[str] = Counter()
    health: list[float] = []
    chat: list[float] = []
    failures: Counter[str] = Counter()
    rss = [rss_mb(pid)]
    before = rss[0]

    def health_loop() -> None:
        # a new connection each time (what a new client meets), over a raw socket: an HTTP client
        # library's own set-up (an SSL context per client) would cost more than the server's answer
        ask = b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        while not stop.is_set():
            started = time.perf_counter()
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
                    sock.sendall(ask)
                    answer = b""
                    while chunk := sock.recv(4096):
                        answer += chunk
                if not answer.startswith(b"HTTP/1.1 200"):
                    raise OSError(f"answered {answer[:12]!r}")
                health.append(time.perf_counter() - started)
            except OSError as exc:
                failures[f"healthz {type(exc).__name__}"] += 1
            stop.wait(0.02)

    def chat_loop() -> None:
        body = {"messages": [{"role": "user", "content": "Write seven as a digit."}], "max_tokens": 8}
        with httpx2.Client(base_url=url, timeout=60) as client:
            while not stop.is_set():
                started = time.perf_counter()
                try:
                    client.post("/v1/chat/completions", json=body).raise_for_status()
                    chat.append(time.perf_counter() - started)
                except httpx2.HTTPError as exc:
                    failures[f"chat {type(exc).__name__}: {str(exc)[:60]}"] += 1

    def rss_loop() -> None:
        while not stop.is_set():
            rss.append(rss_mb(pid))
            stop.wait(0.1)

    threads = [threading.Thread(target=f) for f in (health_loop, chat_loop, rss_loop)]
    if attack is not None:
        threads += [threading.Thread(target=attack, args=(url, port, stop, answers)) for _ in range(workers)]
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join(timeout=120)
    time.sleep(1.0)  # let the server settle before the next scenario's RSS baseline
    return {"health": health, "chat": chat, "failures": failures, "growth": max(rss) - before, "answers": answers}


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=12.0, help="how long each scenario runs")
    args = parser.parse_args()
    model = ensure_embedded_model()
    rows = []
    with server(model) as (url, port, proc):
        baseline = probe(url, proc.pid, args.seconds, None, 0, port)
        rows.append(("baseline: idle server, the probes only", baseline))
        for name, (attack, workers) in SCENARIOS.items():
            print(f"scenario: {name} ...", flush=True)
            rows.append((name, probe(url, proc.pid, args.seconds, attack, workers, port)))
        alive = proc.poll() is None
    base_p99 = pct(baseline["health"], 0.99)  # type: ignore[arg-type]
    columns = f"{'/healthz p50':>12s} {'p99':>8s} {'x idle':>7s} {'chat p99':>9s} {'RSS +MB':>8s} {'fails':>6s}"
    print(f"\n{'scenario':74s} {columns}")
    worst_health = worst_rss = 0.0
    missed = []
    for name, r in rows:
        health, chat = r["health"], r["chat"]
        p99 = pct(health, 0.99)  # type: ignore[arg-type]
        failures = sum(r["failures"].values())  # type: ignore[attr-defined]
        print(
            f"{name:74s} {pct(health, 0.5):10.1f}ms {p99:6.1f}ms {p99 / base_p99:6.1f}x {pct(chat, 0.99):7.0f}ms "  # type: ignore[arg-type]
            f"{r['growth']:8.0f} {failures:6d}"
        )
        if r["answers"]:
            print(f"{'':4s}attackers were answered: {dict(r['answers'])}")
        if failures:
            print(f"{'':4s}probe failures: {dict(r['failures'])}")  # type: ignore[arg-type]
        worst_health, worst_rss = max(worst_health, p99), max(worst_rss, r["growth"])  # type: ignore[arg-type]
        if not (p99 < 100 and r["growth"] < 200):  # type: ignore[operator]
            missed.append(name)
    print(f"\nworst /healthz p99 {worst_health:.1f} ms, worst RSS growth {worst_rss:.0f} MB, server alive: {alive}")
    verdict = "met" if not missed and alive else "NOT met in: " + "; ".join(missed)
    print(f"goal (p99 < 100 ms, RSS growth < 200 MB in every scenario): {verdict}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
