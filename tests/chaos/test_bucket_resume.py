"""Fault injection with an object store: a server mirrored to a local S3 server (moto, ``--checkpoint-uri``) is
killed with SIGKILL during a client run, its state dir is deleted (the machine is gone), and a server started on
an empty state dir with ``--resume`` restores the run from the bucket alone, on the same port.

At the end: every trajectory the client produced is in the new server's log exactly once (lost 0, repeated 0),
the resumed server started from the newest checkpoint with a manifest, every sample from before the kill still
verifies (the signing key came from the bucket), and each accepted trajectory was trained once.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from agentjet_client.delivery.spool import spool_key
from agentjet_server.ingest.wal import TrajectoryLog
from agentjet_server.state.objectstore import open_store
from agentjet_server.state.restore import newest_complete
from tests.chaos.test_client_kill import spool_stats
from tests.chaos.test_server_kill import AGENT
from tests.conftest import ServerProcess, free_port, reap

pytestmark = pytest.mark.e2e
EPISODES = 320


def test_a_server_whose_machine_died_resumes_from_the_bucket_and_loses_nothing(tmp_path, s3_bucket):
    code = tmp_path / "agent"
    code.mkdir()
    (code / "agent.py").write_text(AGENT)
    spool_dir, port = tmp_path / "spool", free_port()
    args = ["--batch-groups", "2", "--group-size", "8", "--checkpoint-every", "3", "--max-staleness", "8"]
    args += ["--entropy-coef", "0.001"]  # a batch whose groups all tie steps too: the kill comes before the run ends
    args += ["--checkpoint-uri", s3_bucket.uri("run"), "--checkpoint-store-options", str(s3_bucket.options)]
    log = tmp_path / "server.log"
    server = ServerProcess([*args, "--state-dir", str(tmp_path / "machine-1")], log, port=port, env=s3_bucket.env)
    exe = str(Path(sys.executable).parent / "agentjet-client")
    command = [exe, "run", "--code-dir", str(code), "--server", server.url, "--episodes", str(EPISODES)]
    command += ["--group-size", "8", "--concurrency", "16", "--spool-dir", str(spool_dir)]
    client = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180
        while True:  # past a checkpoint in the bucket, and pushes acknowledged after it
            assert client.poll() is None, "the client finished before the kill; it should still be running"
            status = server.status()
            uploaded = status["learner"]["last_uploaded_step"]
            if uploaded is not None and status["learner"]["step"] >= uploaded + 2:
                break
            assert time.monotonic() < deadline, f"no checkpoint reached the bucket: {status['learner']}"
            time.sleep(0.05)
        server.kill()
        shutil.rmtree(tmp_path / "machine-1")  # the disk is lost with the machine
        store = open_store(s3_bucket.uri("run"), s3_bucket.options)
        chosen = newest_complete(store, store.list())
        assert chosen is not None
        manifest = chosen[1]
        print(f"killed at step {status['learner']['step']}; the bucket's newest checkpoint: step {manifest['step']}")
        time.sleep(1.0)  # the client notices: pushes fail meanwhile, and stay in its spool
        server = ServerProcess(
            [*args, "--state-dir", str(tmp_path / "machine-2"), "--resume"], log, port=port, env=s3_bucket.env
        )
        assert f"(step {manifest['step']}, policy v{manifest['version']})" in log.read_text()
        out, _ = client.communicate(timeout=600)
        assert client.returncode == 0, out
        deadline = time.monotonic() + 60
        while server.status()["trajectories"]["buffered"] >= 16 and time.monotonic() < deadline:
            time.sleep(0.1)  # the last full batches get trained
        final = server.status()
    finally:
        reap(client)
        server.stop()
    stats = spool_stats(spool_dir / spool_key(server.url))
    trajectory_log = TrajectoryLog(tmp_path / "machine-2" / "log")
    logged = Counter(trajectory_id for _, trajectory_id in trajectory_log.answers())
    trajectory_log.close()
    repeated = [i for i, n in logged.items() if n > 1]
    produced, answered = stats.spooled, stats.spooled - stats.depth
    lost = produced - len(logged)
    counts = final["trajectories"]
    print(
        f"machine lost, resumed from the bucket: produced {produced}, answered {answered} (accepted {stats.accepted}, "
        f"duplicate {stats.duplicate}), in the new server's log {len(logged)} (repeated {len(repeated)}), lost {lost}; "
        f"server: accepted {counts['accepted']}, trained {counts['trained']}, buffered {counts['buffered']}"
    )
    assert produced >= 200 and stats.depth == 0 and answered == produced
    assert lost == 0 and not repeated
    assert counts["accepted"] + counts["rejected"] == len(logged)
    assert "not_sampled" not in counts["rejected_by_reason"] and counts["unsigned_turns"] == 0
    assert counts["trained"] + counts["buffered"] == counts["accepted"]
    assert final["policy_version"] == final["learner"]["step"]
    listing = open_store(s3_bucket.uri("run"), s3_bucket.options).list()
    assert json.loads(store.get("RUN.json"))["run_id"] == final["run_id"]
    assert any(k.endswith("MANIFEST.json") for k in listing)
