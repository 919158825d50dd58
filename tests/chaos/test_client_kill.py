"""Fault injection: the client is killed with SIGKILL mid-run and restarted with the same spool.

Counts, at the end: produced (trajectories committed to the spool, both runs), acknowledged by the
server (accepted + rejected: every answer but duplicate), duplicates, and lost = produced - acked
- still spooled. Lost must be 0.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agentjet_client.delivery.spool import Spool, SpoolStats, spool_key
from tests.conftest import ServerProcess, reap

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


def client(url: str, spool_dir: Path, episodes: int) -> subprocess.Popen[str]:
    exe = str(Path(sys.executable).parent / "agentjet-client")
    command = [exe, "run", "--code-dir", str(ROOT / "examples" / "digits")]
    command += ["--server", url, "--episodes", str(episodes), "--group-size", "8", "--spool-dir", str(spool_dir)]
    env = {**os.environ, "AGENTJET_DIGITS": "3,8"}
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def spool_stats(path: Path) -> SpoolStats:
    spool = Spool(path)
    try:
        return spool.stats()
    finally:
        spool.close()


def tally(stats: SpoolStats, counts: dict[str, int]) -> tuple[int, int, int, int]:
    """produced, acked (every answer but duplicate), duplicate, lost (= produced - acked - still spooled)."""
    acked = counts["accepted"] + counts["rejected"]
    return stats.spooled, acked, counts["duplicate"], stats.spooled - acked - stats.depth


def test_client_killed_mid_run_and_restarted_loses_nothing(model_dir, tmp_path):
    server = ServerProcess(["--batch-groups", "2", "--group-size", "8"], tmp_path / "server.log")
    spool_dir = tmp_path / "spool"
    spool_path = spool_dir / spool_key(server.url)
    first = second = None
    try:
        first = client(server.url, spool_dir, 2000)
        deadline = time.monotonic() + 120
        while not (spool_path / "spool.db").exists() or spool_stats(spool_path).spooled < 150:
            assert first.poll() is None, first.stdout.read() if first.stdout else ""
            assert time.monotonic() < deadline, "the client produced too little before the kill"
            time.sleep(0.05)
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        first.stdout.close()  # type: ignore[union-attr]
        at_kill = spool_stats(spool_path)
        second = client(server.url, spool_dir, 64)
        out, _ = second.communicate(timeout=300)
        assert second.returncode == 0, out
        stats = spool_stats(spool_path)
        counts = server.status()["trajectories"]
    finally:
        for proc in (first, second):
            reap(proc)
        server.stop()
    produced, acked, duplicate, lost = tally(stats, counts)
    print(
        f"client SIGKILL: produced {produced} (at kill {at_kill.spooled}, {at_kill.depth} unsent), "
        f"acked {acked}, duplicate {duplicate}, still spooled {stats.depth}, lost {lost}"
    )
    assert produced >= 150 + 64 and stats.depth == 0
    assert lost == 0
    if at_kill.depth:  # the restarted client announced the leftovers (if the kill left any)
        assert f"{at_kill.depth} trajectories left by an earlier run are sent first" in out.replace("\n", " ")
