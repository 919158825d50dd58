"""An engine replica on another rank of the torchrun job (``--remote-replica-ranks``), end to end: two ranks, rank 1
hosting a replica; a client run is served by both replicas and trains the model; every published version reaches
the replica on rank 1; SIGTERM stops the job."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx2
import pytest

from tests.conftest import CACHE, free_port, run_digits_client, wait_healthy

pytestmark = pytest.mark.e2e


def test_a_replica_on_another_rank_serves_and_follows_every_update(model_dir, tmp_path):
    port = free_port()
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    command += ["-m", "agentjet_server", "up", "--port", str(port), "--state-dir", str(tmp_path / "state")]
    command += ["--remote-replica-ranks", "1", "--batch-groups", "2", "--group-size", "8", "--log-level", "info"]
    command += ["--entropy-coef", "0.001"]  # a batch whose groups all tie steps too: every batch is an update
    env = {**os.environ, "AGENTJET_CACHE_DIR": str(CACHE), "OMP_NUM_THREADS": "1"}
    log = tmp_path / "server.log"
    with log.open("wb") as out:
        job = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(job, url + "/healthz", log, 240)
        run_digits_client(url, 48, 8, "--concurrency", "16")
        deadline = time.monotonic() + 120
        while True:
            status = httpx2.get(url + "/v1/status").json()
            counts = status["trajectories"]
            if counts["trained"] == counts["accepted"]:
                break
            assert time.monotonic() < deadline, counts
            time.sleep(0.2)
        # a request after the last step is sampled by the newest weights on whichever replica takes it
        for _ in range(4):
            body = {"model": "agentjet-tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
            httpx2.post(url + "/v1/chat/completions", json=body, timeout=60).raise_for_status()
        status = httpx2.get(url + "/v1/status").json()
    finally:
        job.terminate()
        try:
            job.wait(timeout=90)
        except subprocess.TimeoutExpired:
            job.kill()
            job.wait(timeout=10)
    text = log.read_text()
    assert counts["accepted"] == 48 and status["learner"]["last_error"] is None, text[-3000:]
    assert status["policy_version"] == 3 and status["learner"]["skipped_batches"] == 0, status["learner"]
    local, remote = status["replicas"]
    assert remote["device"].startswith("remote ") and remote["state"] == "ready"
    assert remote["requests"] > 0 and local["requests"] > 0  # the router spread the run over both
    assert remote["version"] == local["version"] == status["policy_version"]  # every update reached rank 1
    assert "engine replica hosted at" in text and "engine replicas on other ranks: rank 1 at" in text
    assert "stopped at step" in text and "learner rank 1 stopping" in text, text[-3000:]  # a clean stop of both ranks
