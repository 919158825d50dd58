"""Fault injection between client and server: connection drops, a partition (blackhole) and delays
during a run. Counts: produced, acked, duplicates, lost (must be 0)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from agentjet_client.delivery.spool import spool_key
from tests.chaos.faultproxy import FaultProxy
from tests.chaos.test_client_kill import spool_stats, tally
from tests.conftest import ServerProcess, reap

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
SCHEDULE = [("pass", 1.0), ("drop", 1.0), ("pass", 1.0), ("blackhole", 3.0), ("pass", 1.0), ("delay", 1.5)]


def test_drops_partition_and_delays_lose_nothing(model_dir, tmp_path):
    server = ServerProcess(["--batch-groups", "2", "--group-size", "8"], tmp_path / "server.log")
    proxy = FaultProxy(int(server.url.rsplit(":", 1)[1]))
    spool_dir = tmp_path / "spool"
    stop = threading.Event()
    seen: list[str] = []

    def chaos() -> None:
        while not stop.is_set():
            for mode, seconds in SCHEDULE:
                if stop.is_set():
                    break
                proxy.set_mode(mode)
                seen.append(mode)
                stop.wait(seconds)
        proxy.set_mode("pass")

    exe = str(Path(sys.executable).parent / "agentjet-client")
    command = [exe, "run", "--code-dir", str(ROOT / "examples" / "digits"), "--server", proxy.url]
    command += ["--episodes", "480", "--group-size", "8", "--timeout", "20", "--spool-dir", str(spool_dir)]
    try:
        client = subprocess.Popen(
            command,
            env={**os.environ, "AGENTJET_DIGITS": "3,8"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        time.sleep(1.0)  # let the client's start-up status call through
        faults = threading.Thread(target=chaos)
        faults.start()
        try:
            out, _ = client.communicate(timeout=400)
        finally:
            stop.set()
            faults.join()
            reap(client)
        assert client.returncode == 0, out
        stats = spool_stats(spool_dir / spool_key(proxy.url))
        counts = server.status()["trajectories"]
    finally:
        proxy.close()
        server.stop()
    produced, acked, duplicate, lost = tally(stats, counts)
    print(
        f"network faults ({len(seen)} mode switches, {proxy.counts}): produced {produced}, acked {acked}, "
        f"duplicate {duplicate}, still spooled {stats.depth}, lost {lost}"
    )
    assert {"drop", "blackhole"} <= set(seen) and proxy.counts["dropped"] and proxy.counts["blackholed"]
    assert produced == 480 and stats.depth == 0 and lost == 0
