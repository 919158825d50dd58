"""End to end: a real ``agentjet-server up`` and a real ``agentjet-client run``, both processes, on loopback.

The run trains on two of the demo's words so it stays short; the test asserts that trajectories
were accepted, the policy version advanced, and the reward rose.
"""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx2
import pytest

from tests.conftest import CACHE, free_port

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent

pytestmark = pytest.mark.e2e


def test_server_and_client_processes_train_the_model(model_dir, tmp_path):
    port = free_port()
    env = {**os.environ, "AGENTJET_CACHE_DIR": str(CACHE), "AGENTJET_DIGITS": "3,8"}
    log = (tmp_path / "server.log").open("w")
    server = subprocess.Popen(
        [
            str(BIN / "agentjet-server"),
            "up",
            "--port",
            str(port),
            "--batch-groups",
            "2",
            "--group-size",
            "16",
            "--lr",
            "1e-3",
            "--state-dir",
            str(tmp_path / "state"),
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()
            try:
                if httpx2.get(url + "/healthz").status_code == 200:
                    break
            except httpx2.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.2)
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
        server.terminate()
        server.wait(timeout=30)
        log.close()
