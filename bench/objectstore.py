"""Pushes with the trajectory log mirrored to an object store (``--checkpoint-uri``), side by side.

    python bench/objectstore.py [--pushes 2000] [--concurrency 16] [--put-delay-ms 30]

The server's ingest path in one process (``TrajectoryStore`` over a ``TrajectoryLog`` on local disk,
fsynced), the store a local S3 server (moto's server, its own process on 127.0.0.1, through s3fs). Same pushes
(4 one-turn trajectories each), ``--concurrency`` pushing at once, for: (a) no object store; (b)
``--remote-log async`` (answered at once, shipped behind); (c) ``--remote-log ack`` (answered once the
bytes are in the bucket: group commit, one put for whatever arrived meanwhile); (d) ``ack`` with
``--put-delay-ms`` added to every put, for a store farther away than loopback (S3's own PUT takes
tens of milliseconds). Reported: pushes per second, p50 and p99 of a push, and puts per push.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from agentjet_client.protocol import Trajectory, Turn
from agentjet_server.ingest.store import TrajectoryStore
from agentjet_server.ingest.wal import TrajectoryLog
from agentjet_server.state.objectstore import ObjectStore, open_store
from agentjet_server.state.shipping import LogShipper


class Delayed(ObjectStore):
    def __init__(self, inner: ObjectStore, delay: float) -> None:
        super().__init__(inner.fs, inner.root, inner.uri)
        self.delay = delay

    def put(self, key: str, data: bytes) -> None:
        time.sleep(self.delay)
        super().put(key, data)


def batches(pushes: int) -> list[list[Trajectory]]:
    turn = Turn(
        policy_version=0,
        prompt_token_ids=list(range(200)),
        completion_token_ids=list(range(60)),
        completion_logprobs=[-0.5] * 60,
        finish_reason="stop",
    )
    return [
        [Trajectory(id=f"p{p}-{i}", task_id=f"task{p}", turns=[turn], reward=float(i % 2)) for i in range(4)]
        for p in range(pushes)
    ]


def run(root: Path, work: list[list[Trajectory]], concurrency: int, store: ObjectStore | None, mode: str) -> dict:  # type: ignore[type-arg]
    log = TrajectoryLog(root)
    shipper = LogShipper(store, log.position, mode=mode) if store is not None else None  # type: ignore[arg-type]
    log.mirror = shipper
    ingest = TrajectoryStore(1000, 1000, lambda t, n: None, log)
    queue, latencies, lock = list(reversed(work)), [], threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                if not queue:
                    return
                batch = queue.pop()
            started = time.perf_counter()
            assert all(r.status == "accepted" for r in ingest.admit_batch(batch, 0))
            with lock:
                latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - started
    parts = 0
    if shipper is not None:
        assert shipper.flush(120)
        parts = shipper.parts
        shipper.close()
    log.close()
    latencies.sort()
    return {
        "rate": len(work) / seconds,
        "p50": statistics.median(latencies) * 1000,
        "p99": latencies[int(len(latencies) * 0.99) - 1] * 1000,
        "puts": parts / len(work),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pushes", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--put-delay-ms", type=float, default=30.0)
    args = parser.parse_args()
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
    import boto3

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # a process of its own, as a real store is (in this one it would take the interpreter's lock from the pushes)
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
            break
        except Exception:  # not listening yet
            time.sleep(0.1)
    work = batches(args.pushes)
    rows: dict[str, dict] = {}  # type: ignore[type-arg]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            options = Path(tmp) / "options.json"
            options.write_text(f'{{"endpoint_url": "{endpoint}"}}')
            configs = [
                ("(a) no object store", None, "ack"),
                ("(b) --remote-log async", "async", "async"),
                ("(c) --remote-log ack", "ack", "ack"),
                (f"(d) ack, puts +{args.put_delay_ms:g} ms", "slow", "ack"),
            ]
            for name, prefix, mode in configs:
                print(f"{name} ...", flush=True)
                store = None
                if prefix is not None:
                    store = open_store(f"s3://bench/{prefix}", options)
                    if prefix == "slow":
                        store = Delayed(store, args.put_delay_ms / 1000)
                rows[name] = run(Path(tmp) / name[:3], work, args.concurrency, store, mode)
    finally:
        server.terminate()
        server.wait(timeout=30)
    base = rows["(a) no object store"]
    print(f"\n{args.pushes} pushes of 4 trajectories, {args.concurrency} at once; the store: moto on 127.0.0.1")
    print("| log | pushes/s | vs none | p50 ms | p99 ms | puts per push |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, row in rows.items():
        print(
            f"| {name} | {row['rate']:,.0f} | {row['rate'] / base['rate']:.2f}x | {row['p50']:.1f} | {row['p99']:.1f} "
            f"| {row['puts']:.3f} |"
        )


if __name__ == "__main__":
    main()
