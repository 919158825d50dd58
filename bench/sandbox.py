"""The local sandbox's cost on this machine: start, exec and stop latency, and oracle episodes per second with
1, 8 and 32 sandboxes at once.

Latency: ``--sandboxes`` sandboxes one after another, each started, one ``true`` run in it, stopped (p50 and
p99 of each step). Throughput: ``--episodes`` episodes of ``examples/terminal_tasks`` (round robin over its
tasks), each a fresh sandbox with the task's environment copied in, the reference solution run, the tests run
and the reward read, then the sandbox removed: as many at once as the concurrency says. Every episode must
score 1 (the oracle), or the run stops.

    .venv/bin/python bench/sandbox.py [--sandboxes 50] [--episodes 96] [--concurrency 1,8,32]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from agentjet_client.sandbox import LocalSandbox, read_task_dirs, run_oracle, task_sandbox, verify

TASKS = Path(__file__).resolve().parents[1] / "examples" / "terminal_tasks"


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def latency(count: int, root: Path) -> dict[str, list[float]]:
    steps: dict[str, list[float]] = {"start": [], "exec": [], "stop": []}
    for _ in range(count):
        box = LocalSandbox(root=root)
        began = time.perf_counter()
        await box.start()
        steps["start"].append(time.perf_counter() - began)
        began = time.perf_counter()
        done = await box.exec("true")
        steps["exec"].append(time.perf_counter() - began)
        assert done.ok, done
        began = time.perf_counter()
        await box.stop()
        steps["stop"].append(time.perf_counter() - began)
    return steps


async def throughput(episodes: int, concurrency: int, root: Path) -> float:
    tasks = read_task_dirs(TASKS)
    queue = list(range(episodes))

    async def worker() -> None:
        while queue:
            task = tasks[queue.pop() % len(tasks)]
            async with task_sandbox(task, root) as (box, terminal):
                assert (await run_oracle(box, terminal)).ok
                verdict = await verify(box, terminal)
                assert verdict.reward == 1.0, (terminal.name, verdict)

    began = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return episodes / (time.perf_counter() - began)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sandboxes", type=int, default=50, help="sandboxes for the latency figures")
    parser.add_argument("--episodes", type=int, default=96, help="oracle episodes per concurrency")
    parser.add_argument("--concurrency", default="1,8,32", help="sandboxes at once, comma-separated")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="agentjet-bench-") as scratch:
        root = Path(scratch)
        steps = asyncio.run(latency(args.sandboxes, root))
        print(f"latency over {args.sandboxes} sandboxes, one after another:", flush=True)
        print("| step | p50 | p99 |\n|---|---:|---:|")
        for name, values in steps.items():
            print(f"| {name} | {pct(values, 0.5) * 1e3:.1f} ms | {pct(values, 0.99) * 1e3:.1f} ms |")
        print(flush=True)
        print(f"oracle episodes ({args.episodes} each; start, copy in, solve, test, reward, stop):", flush=True)
        print("| sandboxes at once | episodes/s |\n|---:|---:|")
        for concurrency in [int(c) for c in args.concurrency.split(",")]:
            rate = asyncio.run(throughput(args.episodes, concurrency, root))
            print(f"| {concurrency} | {rate:.1f} |", flush=True)


if __name__ == "__main__":
    main()
