"""Two nodes on one machine: two ``torchrun --nnodes 2`` agents rendezvous on 127.0.0.1 (c10d),
each starting two ranks; global rank 0 serves, all four ranks train (FSDP2, gloo), a client run is
trained, and SIGTERM to both agents stops the job with a last checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import httpx2
import pytest

from tests.conftest import CACHE, free_port, run_digits_client, wait_healthy

pytestmark = pytest.mark.e2e


def _agent(port: int, rendezvous: int, node_log: IO[bytes], state: Path) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "2"]
    command += ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{rendezvous}", "--rdzv_id", "agentjet-test"]
    command += ["-m", "agentjet_server", "up", "--port", str(port), "--state-dir", str(state)]
    # an entropy bonus gives a batch whose groups all tie a gradient too: every batch of 16 episodes steps
    command += ["--batch-groups", "2", "--group-size", "8", "--entropy-coef", "0.001", "--log-level", "info"]
    env = {**os.environ, "AGENTJET_CACHE_DIR": str(CACHE), "AGENTJET_DIGITS": "3,8", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(command, env=env, stdout=node_log, stderr=subprocess.STDOUT)


def test_two_torchrun_nodes_rendezvous_and_train_from_a_client_run(model_dir, tmp_path):
    port, rendezvous = free_port(), free_port()
    state = tmp_path / "state"  # one path for both nodes, as shared storage would give them
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    files = [log.open("wb") for log in logs]
    agents = [_agent(port, rendezvous, f, state) for f in files]
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(agents[0], url + "/healthz", logs[0], 240)
        run_digits_client(url, 48, 8)
        deadline = time.monotonic() + 120
        while True:  # the learner takes the last batches after the client is done
            status = httpx2.get(url + "/v1/status").json()
            counts = status["trajectories"]
            if counts["trained"] == counts["accepted"]:
                break
            assert time.monotonic() < deadline, counts
            time.sleep(0.2)
        assert counts["accepted"] == 48 and status["learner"]["last_error"] is None
        assert status["learner"]["step"] == 3 and status["policy_version"] == 3, status["learner"]
    finally:
        for agent in agents:
            agent.terminate()
        for agent in agents:
            try:
                agent.wait(timeout=60)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait(timeout=10)
        for f in files:
            f.close()
    text = "\n".join(log.read_text() for log in logs)
    for rank in (1, 2, 3):
        assert f"learner rank {rank} of 4" in text, text[-3000:]
    assert "FSDP2" in text
    for log in logs:  # each agent started two of the four ranks
        assert sum(f"learner rank {r} of 4" in log.read_text() for r in range(4)) == 2, log.read_text()[-2000:]
    step = status["learner"]["step"]
    assert (state / "checkpoints" / f"step-{step:08d}" / "model" / "config.json").exists()
