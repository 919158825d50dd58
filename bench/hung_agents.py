"""Runner throughput when some sync episodes hang in a blocking call, side by side in one run.

    python bench/hung_agents.py [--episodes 160] [--concurrency 8] [--timeout 2]

Runs of a sync agent against one real server (embedded model), same tasks and settings:
(a) no episode hangs (threads), (a2) no hangs (worker processes: the cost of isolation); (b)
every 8th task's episodes call ``time.sleep(10**6)``, agents in
threads (what a plain runner can do: the stuck threads cannot be stopped); (c) the same hangs,
agents in worker processes (``WorkerPool``: a hung episode's worker is killed at the timeout and
replaced). Reported: completed (non-hung) episodes per second, and threads / processes left.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

from _server import served
from agentjet_client import RunConfig, Runner, SwarmClient
from agentjet_client.isolation import WorkerPool
from agentjet_client.loader import load_agent

AGENT = """
import os, time
from agentjet_client import swarm_agent

HANG = os.environ.get("AGENTJET_BENCH_HANG") == "1"

@swarm_agent(tasks=[{"id": f"t{i}"} for i in range(8)])
def agent(task, episode):
    reply = episode.openai().chat.completions.create(
        model="agentjet-tiny", messages=[{"role": "user", "content": "Write four as a digit."}], max_tokens=3
    )
    if HANG and task["id"] == "t0":
        time.sleep(10**6)
    return float(reply.choices[0].message.content.strip() == "4")
"""


def run(url: str, code_dir: Path, episodes: int, concurrency: int, timeout: float, processes: bool) -> dict[str, float]:
    agent, version = load_agent(code_dir)
    pool = WorkerPool(code_dir, concurrency) if processes else None
    config = RunConfig(episodes=episodes, group_size=4, concurrency=concurrency, timeout=timeout, seed=0)
    threads = threading.active_count()
    with SwarmClient(url) as client:
        started = time.perf_counter()
        report = asyncio.run(Runner(client, agent, config, code_version=version, workers=pool).run())
        seconds = time.perf_counter() - started
    return {
        "ok_per_s": len(report.rewards) / seconds,
        "completed": len(report.rewards),
        "timed_out": report.failure_reasons.get(f"episode timed out after {timeout:g}s", 0),
        "threads_left": threading.active_count() - threads,
        "processes_started": pool.started if pool else 0,
        "processes_live": pool.live if pool else 0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=160)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=2.0)
    args = parser.parse_args()
    from agentjet_server.embedded import ensure_embedded_model

    rows = {}
    with tempfile.TemporaryDirectory() as tmp, served(ensure_embedded_model(), "--batch-groups", "1000") as url:
        code_dir = Path(tmp)
        (code_dir / "agent.py").write_text(AGENT)
        os.environ["AGENTJET_BENCH_HANG"] = "0"
        print("(a) no hangs ...", flush=True)
        common = (url, code_dir, args.episodes, args.concurrency, args.timeout)
        rows["(a) no hangs, threads"] = run(*common, False)
        print("(a2) no hangs, worker processes ...", flush=True)
        rows["(a2) no hangs, processes"] = run(*common, True)
        os.environ["AGENTJET_BENCH_HANG"] = "1"
        print("(c) hangs, worker processes ...", flush=True)
        rows["(c) 1 task in 8 hangs, processes"] = run(*common, True)
        print("(b) hangs, threads ...", flush=True)  # last: its stuck threads never end
        rows["(b) 1 task in 8 hangs, threads"] = run(*common, False)
    base = rows["(a) no hangs, threads"]["ok_per_s"]
    print(f"\n{args.episodes} episodes, concurrency {args.concurrency}, timeout {args.timeout:g}s")
    print("| run | ok episodes/s | vs (a) | completed | timed out | threads left | processes started / live |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        print(
            f"| {name} | {r['ok_per_s']:.1f} | {r['ok_per_s'] / base:.2f} | {r['completed']:.0f} | "
            f"{r['timed_out']:.0f} | {r['threads_left']:.0f} | "
            f"{r['processes_started']:.0f} / {r['processes_live']:.0f} |"
        )
    sys.stdout.flush()
    os._exit(0)  # run (b)'s threads are still asleep in time.sleep(10**6): nothing can join them


if __name__ == "__main__":
    main()
