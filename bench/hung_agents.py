"""Runner throughput when some episodes hang, against the same run without hangs, side by side.

    python bench/hung_agents.py [--episodes 400] [--concurrency 8] [--timeout 2] [--tasks 100] [--env-delay 0.1]

One real server (embedded model); an agent that makes one LLM call and then spends ``--env-delay``
seconds in its environment. Of ``--tasks`` tasks, ``t0`` hangs: a sync agent in ``time.sleep(10**6)``,
an async one awaiting a future nobody resolves. Each pair of runs uses the same tasks and settings:

  sync agent, worker processes (``WorkerPool``, the default for sync agents from a code dir):
      a hung episode's worker is killed at the timeout; a warm spare takes its place
  async agent: the hung episode is cancelled at the timeout
  sync agent, threads (``--no-isolate``): what a plain runner can do; stuck threads stay stuck

Reported: completed (non-hung) episodes per second, the ratio to the same mode without hangs, and
threads / processes left behind. A hang costs its slot ``--timeout`` seconds no matter what; the
"floor" column is the ratio that cost alone allows (slot time of the no-hang run over slot time
plus hung episodes x timeout).
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
from agentjet_client.run.isolation import WorkerPool
from agentjet_client.run.loader import load_agent

SYNC = """
import os, time
from agentjet_client import swarm_agent

HANG = os.environ.get("AGENTJET_BENCH_HANG") == "1"
DELAY = float(os.environ["AGENTJET_BENCH_DELAY"])

@swarm_agent(tasks=[{"id": f"t{i}"} for i in range(int(os.environ["AGENTJET_BENCH_TASKS"]))])
def agent(task, episode):
    reply = episode.openai().chat.completions.create(
        model="agentjet-tiny", messages=[{"role": "user", "content": "Write four as a digit."}], max_tokens=3
    )
    if HANG and task["id"] == "t0":
        time.sleep(10**6)
    time.sleep(DELAY)
    return float(reply.choices[0].message.content.strip() == "4")
"""

ASYNC = """
import asyncio, os
from agentjet_client import swarm_agent

HANG = os.environ.get("AGENTJET_BENCH_HANG") == "1"
DELAY = float(os.environ["AGENTJET_BENCH_DELAY"])

@swarm_agent(tasks=[{"id": f"t{i}"} for i in range(int(os.environ["AGENTJET_BENCH_TASKS"]))])
async def agent(task, episode):
    reply = await episode.async_openai().chat.completions.create(
        model="agentjet-tiny", messages=[{"role": "user", "content": "Write four as a digit."}], max_tokens=3
    )
    if HANG and task["id"] == "t0":
        await asyncio.get_running_loop().create_future()  # never resolved
    await asyncio.sleep(DELAY)
    return float(reply.choices[0].message.content.strip() == "4")
"""


def run(url: str, code_dir: Path, args: argparse.Namespace, processes: bool) -> dict[str, float]:
    agent, version = load_agent(code_dir)
    pool = WorkerPool(code_dir, args.concurrency) if processes else None
    config = RunConfig(episodes=args.episodes, group_size=4, concurrency=args.concurrency, timeout=args.timeout, seed=0)
    threads = threading.active_count()
    with SwarmClient(url) as client:
        started = time.perf_counter()
        report = asyncio.run(Runner(client, agent, config, code_version=version, workers=pool).run())
        seconds = time.perf_counter() - started
    return {
        "seconds": seconds,
        "ok_per_s": len(report.rewards) / seconds,
        "completed": len(report.rewards),
        "timed_out": report.failure_reasons.get(f"episode timed out after {args.timeout:g}s", 0),
        "threads_left": threading.active_count() - threads,
        "processes": f"{pool.started} / {pool.peak} / {pool.live}" if pool else "-",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=2.0)
    parser.add_argument("--tasks", type=int, default=100, help="one task in this many hangs")
    parser.add_argument("--env-delay", type=float, default=0.1, help="seconds each episode spends in its environment")
    args = parser.parse_args()
    from agentjet_server.embedded import ensure_embedded_model

    os.environ["AGENTJET_BENCH_TASKS"] = str(args.tasks)
    os.environ["AGENTJET_BENCH_DELAY"] = str(args.env_delay)
    plan = [  # (name, code, processes, hang); threads with hangs last: its stuck threads never end
        ("sync, worker processes", SYNC, True, False),
        ("sync, worker processes", SYNC, True, True),
        ("async", ASYNC, False, False),
        ("async", ASYNC, False, True),
        ("sync, threads", SYNC, False, False),
        ("sync, threads", SYNC, False, True),
    ]
    rows: list[tuple[str, bool, dict[str, float]]] = []
    with tempfile.TemporaryDirectory() as tmp, served(ensure_embedded_model(), "--batch-groups", "1000") as url:
        for name, code, processes, hang in plan:
            code_dir = Path(tmp) / f"{'async' if code is ASYNC else 'sync'}"
            code_dir.mkdir(exist_ok=True)
            (code_dir / "agent.py").write_text(code)
            os.environ["AGENTJET_BENCH_HANG"] = "1" if hang else "0"
            print(f"{name}, {'hangs' if hang else 'no hangs'} ...", flush=True)
            rows.append((name, hang, run(url, code_dir, args, processes)))
    print(
        f"\n{args.episodes} episodes, concurrency {args.concurrency}, timeout {args.timeout:g}s, "
        f"1 task in {args.tasks} hangs, {args.env_delay:g}s environment per episode"
    )
    print(
        "| agent, runner | hangs | ok episodes/s | vs no hangs | floor | completed | timed out | threads left "
        "| processes started / peak / left |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    baseline: dict[str, dict[str, float]] = {}
    for name, hang, r in rows:
        if not hang:
            baseline[name] = r
        base = baseline[name]
        floor = base["seconds"] * args.concurrency
        floor = floor / (floor + r["timed_out"] * args.timeout)
        print(
            f"| {name} | {'yes' if hang else 'no'} | {r['ok_per_s']:.1f} | {r['ok_per_s'] / base['ok_per_s']:.2f} | "
            f"{floor:.2f} | {r['completed']:.0f} | {r['timed_out']:.0f} | {r['threads_left']:.0f} | {r['processes']} |"
        )
    sys.stdout.flush()
    os._exit(0)  # the thread run's hung threads are still asleep in time.sleep(10**6): nothing can join them


if __name__ == "__main__":
    main()
