"""Spooling finished trajectories: one commit per trajectory vs group commit, side by side.

    python bench/spool.py [--trajectories 4000] [--concurrency 32]

``--concurrency`` episodes finish at once and each waits until its trajectory is durable (SQLite,
WAL, ``synchronous=FULL``) before it goes on, as in the runner. (a) each trajectory is its own
transaction (``Spool.put`` in a thread; how the runner spooled before), (b) ``GroupCommit``:
trajectories that finish while a commit is in flight share the next one. Same trajectories, fresh
spool each; reported: trajectories per second and commits (fsyncs) per trajectory.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from agentjet_client.delivery.spool import GroupCommit, Spool
from agentjet_client.protocol import Trajectory, Turn


def trajectories(n: int) -> list[Trajectory]:
    turn = Turn(
        policy_version=3,
        request_messages=[{"role": "user", "content": "Write seven as a digit."}],
        prompt_token_ids=list(range(30)),
        completion_token_ids=[17, 2],
        completion_logprobs=[-0.1, -0.01],
        finish_reason="stop",
    )
    return [Trajectory(id=f"t{i}", task_id=f"task{i // 16}", turns=[turn], reward=1.0) for i in range(n)]


async def produce(items: list[Trajectory], concurrency: int, put) -> float:  # type: ignore[no-untyped-def]
    queue = list(reversed(items))

    async def episode_slot() -> None:
        while queue:
            trajectory = queue.pop()
            await asyncio.sleep(0)  # the episode's own work would be here
            assert await put(trajectory)

    started = time.perf_counter()
    await asyncio.gather(*(episode_slot() for _ in range(concurrency)))
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trajectories", type=int, default=4000)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    items = trajectories(args.trajectories)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        one = Spool(Path(tmp) / "one")
        print("(a) one commit per trajectory ...", flush=True)
        seconds = asyncio.run(produce(items, args.concurrency, lambda t: asyncio.to_thread(one.put, t)))
        assert one.depth == len(items)
        rows["(a) one commit per trajectory"] = (seconds, float(len(items)))
        one.close()
        grouped = Spool(Path(tmp) / "grouped")
        group = GroupCommit(grouped)
        print("(b) group commit ...", flush=True)
        seconds = asyncio.run(produce(items, args.concurrency, group.put))
        assert grouped.depth == len(items)
        rows["(b) group commit"] = (seconds, float(group.commits))
        grouped.close()
    base = rows["(a) one commit per trajectory"][0]
    print(f"\n{args.trajectories} trajectories, {args.concurrency} finishing at once")
    print("| spooling | trajectories/s | speed-up | commits per trajectory |")
    print("|---|---:|---:|---:|")
    for name, (seconds, commits) in rows.items():
        print(f"| {name} | {len(items) / seconds:,.0f} | {base / seconds:.1f}x | {commits / len(items):.3f} |")


if __name__ == "__main__":
    main()
