"""End to end: a real ``agentjet-server up`` and a real ``agentjet-client run``, both processes, on loopback.

The run trains on two of the demo's words so it stays short; the test asserts that trajectories
were accepted, the policy version advanced, and the reward rose.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx2
import pytest

from tests.conftest import CACHE, ServerProcess, run_digits_client

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent

pytestmark = pytest.mark.e2e


def test_server_and_client_processes_train_the_model(model_dir, tmp_path):
    env = {**os.environ, "AGENTJET_CACHE_DIR": str(CACHE), "AGENTJET_DIGITS": "3,8"}
    args = ["--batch-groups", "2", "--group-size", "16", "--lr", "1e-3", "--state-dir", str(tmp_path / "state")]
    server = ServerProcess(args, tmp_path / "server.log", env=env)
    url = server.url
    try:
        client = subprocess.run(
            [
                str(BIN / "agentjet-client"),
                "run",
                "--code-dir",
                str(ROOT / "examples" / "digits"),
                "--server",
                url,
                "--episodes",
                "1600",
                "--group-size",
                "16",
                "--concurrency",
                "16",
                "--seed",
                "0",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert client.returncode == 0, client.stdout + client.stderr
        out = client.stdout.replace("\n", " ")
        assert "episodes" in out  # progress was printed
        first = float(re.search(r"first 10% ([0-9.]+)", out).group(1))
        last = float(re.search(r"last 20% ([0-9.]+)", out).group(1))
        status = json.loads(httpx2.get(url + "/v1/status").text)
        assert status["trajectories"]["accepted"] == 1600
        assert status["trajectories"]["rejected"] == 0
        assert status["policy_version"] >= 10
        assert last > first + 0.4, out
        print(out.split("done:")[-1])
    finally:
        server.stop()


def test_learner_under_torchrun_with_two_ranks_trains_from_a_client_run(model_dir, tmp_path):
    """``torchrun --nproc_per_node 2 -m agentjet_server up``: rank 0 serves, both ranks train (FSDP2, gloo)."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    launcher += ["-m", "agentjet_server"]
    state = tmp_path / "state"
    args = ["--batch-groups", "2", "--group-size", "8", "--log-level", "info", "--state-dir", str(state)]
    server = ServerProcess(args, tmp_path / "server.log", env={"AGENTJET_DIGITS": "3,8"}, launcher=launcher)
    try:
        run_digits_client(server.url, 320, 8)
        status = server.status()
        assert status["trajectories"]["accepted"] == 320
        assert status["learner"]["step"] >= 3 and status["policy_version"] >= 3
        assert status["learner"]["last_error"] is None
    finally:
        server.stop()  # SIGTERM: rank 0 writes the last checkpoint, gathering rank 1's shards
    log = (tmp_path / "server.log").read_text()
    assert "learner rank 1 of 2" in log and "learner rank 1 waiting for batches" in log and "FSDP2" in log
    step, version = status["learner"]["step"], status["policy_version"]
    assert (state / "checkpoints" / f"step-{step:08d}" / "model" / "config.json").exists()

    # resume on 2 ranks: same version numbering, optimizer shards back on both ranks, training goes on
    server = ServerProcess([*args, "--resume"], tmp_path / "resumed.log", launcher=launcher)
    try:
        assert server.status()["policy_version"] == version
        run_digits_client(server.url, 160, 8)
        status = server.status()
        assert status["trajectories"]["accepted"] == 480 and status["learner"]["last_error"] is None
        assert status["learner"]["step"] > step and status["policy_version"] > version
    finally:
        server.stop()
    assert f"(step {step}, policy v{version})" in (tmp_path / "resumed.log").read_text()
