"""Fault injection on an elastic pool of clients: six client slots, each the client image's entrypoint
(``deploy/client/entrypoint.sh``) configured only by environment variables with a spool of its own, are killed at
random (SIGKILL or SIGTERM) and restarted for a minute against one server, as spot instances come and go.

At the end every slot is restarted once more to send what it left. Counts: produced (trajectories committed to the
slots' spools), in the server's log (each must be there exactly once), lost = produced - logged. Lost must be 0,
nothing is logged twice, and every accepted trajectory is trained once (trained + buffered = accepted, one policy
version per step). ``AGENTJET_CHAOS_SECONDS`` sets another length: the suite's minute (about 20 kills, 4 CPU-minutes
less than the three it ran before) keeps CI short; longer runs, and loops of short ones, look for rarer windows.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from agentjet_client.delivery.spool import spool_key
from agentjet_server.ingest.wal import TrajectoryLog
from tests.chaos.test_client_kill import spool_stats
from tests.chaos.test_server_kill import AGENT
from tests.conftest import ServerProcess

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
SLOTS = 6
SECONDS = float(os.environ.get("AGENTJET_CHAOS_SECONDS", "60"))


class Slot:
    """One place in the pool: a client process started from the environment, killed and started again."""

    def __init__(self, index: int, env: dict[str, str], logs: Path) -> None:
        self.index, self.env, self.logs = index, env, logs
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self, episodes: int = 0) -> None:
        self.starts += 1
        out = (self.logs / f"slot-{self.index}-{self.starts}.log").open("wb")
        env = {**self.env, "AGENTJET_CLIENT_EPISODES": str(episodes)}
        self.proc = subprocess.Popen(
            ["sh", str(ROOT / "deploy" / "client" / "entrypoint.sh")], env=env, stdout=out, stderr=subprocess.STDOUT
        )
        out.close()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self, how: signal.Signals) -> None:
        assert self.proc is not None
        self.proc.send_signal(how)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)


def settled(server: ServerProcess, limit: float = 120) -> dict:  # type: ignore[type-arg]
    """The status once the learner has taken every full batch: the same counts twice, a second apart."""
    deadline, last = time.monotonic() + limit, None
    while True:
        status = server.status()
        now = (status["trajectories"]["trained"], status["trajectories"]["buffered"], status["policy_version"])
        if now == last:
            return status  # type: ignore[no-any-return]
        assert time.monotonic() < deadline, f"the learner never settled: {status['trajectories']}"
        last = now
        time.sleep(1.5)


def test_an_elastic_pool_killed_at_random_loses_nothing_and_trains_nothing_twice(tmp_path):
    seed = random.SystemRandom().randrange(1 << 30)
    rng = random.Random(seed)
    print(f"elastic pool: seed {seed}, {SECONDS:.0f} s")
    (tmp_path / "agent").mkdir()
    (tmp_path / "agent" / "agent.py").write_text(AGENT)
    (tmp_path / "logs").mkdir()
    args = ["--group-size", "4", "--batch-groups", "2", "--max-staleness", "50", "--checkpoint-every", "5"]
    server = ServerProcess([*args, "--state-dir", str(tmp_path / "state")], tmp_path / "server.log")
    base = {k: v for k, v in os.environ.items() if not k.startswith("AGENTJET_")}
    base["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{base.get('PATH', '')}"
    slots = [
        Slot(
            i,
            {
                **base,
                "AGENTJET_CLIENT_SERVER": server.url,
                "AGENTJET_CLIENT_CODE_DIR": str(tmp_path / "agent"),
                "AGENTJET_CLIENT_SPOOL_DIR": str(tmp_path / f"spool-{i}"),
                "AGENTJET_CLIENT_CONCURRENCY": "8",
                "AGENTJET_CLIENT_HEARTBEAT_FILE": str(tmp_path / f"heartbeat-{i}"),
            },
            tmp_path / "logs",
        )
        for i in range(SLOTS)
    ]
    kills: Counter[str] = Counter()
    try:
        for slot in slots:
            slot.start()
        deadline = time.monotonic() + SECONDS
        while time.monotonic() < deadline:
            time.sleep(rng.uniform(1.0, 4.0))
            slot = rng.choice(slots)
            if slot.running:
                how = rng.choice([signal.SIGKILL, signal.SIGTERM])
                slot.kill(how)
                kills[how.name] += 1
            if rng.random() < 0.8:  # most come back at once; some stay away a while
                slot.start()
            for other in slots:
                if not other.running and rng.random() < 0.3:
                    other.start()
        for slot in slots:  # the pool shrinks to nothing
            if slot.running:
                slot.kill(signal.SIGTERM)
        for slot in slots:  # each place comes back once: what its predecessors left is sent first
            slot.start(episodes=4)
        for slot in slots:
            assert slot.proc is not None
            assert slot.proc.wait(timeout=300) == 0, (
                tmp_path / "logs" / f"slot-{slot.index}-{slot.starts}.log"
            ).read_text()[-3000:]
        final = settled(server)
    finally:
        for slot in slots:
            if slot.running:
                slot.kill(signal.SIGKILL)
        server.stop()
    stats = [spool_stats(tmp_path / f"spool-{i}" / spool_key(server.url)) for i in range(SLOTS)]
    log = TrajectoryLog(tmp_path / "state" / "log")
    logged = Counter(trajectory_id for _, trajectory_id in log.answers())
    log.close()
    produced = sum(s.spooled for s in stats)
    left = sum(s.depth for s in stats)
    repeated = [i for i, n in logged.items() if n > 1]
    counts = final["trajectories"]
    print(
        f"elastic pool: {sum(s.starts for s in slots)} starts, kills {dict(kills)}; produced {produced}, "
        f"in the server's log {len(logged)} (repeated {len(repeated)}), lost {produced - len(logged)}, left {left}; "
        f"server: accepted {counts['accepted']}, duplicate {counts['duplicate']}, trained {counts['trained']}, "
        f"buffered {counts['buffered']}, policy v{final['policy_version']}"
    )
    assert sum(kills.values()) >= SECONDS / 6 and produced >= 100
    assert left == 0 and produced == len(logged) and not repeated
    assert counts["accepted"] + counts["rejected"] == len(logged)
    assert counts["trained"] + counts["buffered"] == counts["accepted"]
    assert final["policy_version"] == final["learner"]["step"]
