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
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import CACHE, ServerProcess, run_digits_client

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent

pytestmark = pytest.mark.e2e


def scrape(url: str) -> dict[str, float]:
    """``/metrics`` parsed by prometheus-client's own parser: ``name{label=value,...}`` -> value."""
    samples = {}
    for family in text_string_to_metric_families(httpx2.get(url + "/metrics").text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def test_server_and_client_processes_train_the_model(model_dir, tmp_path):
    """The demo task trains: the running reward rises, and so does the reward of evaluation episodes
    (never trained) by policy version. ``/metrics``, scraped while the client runs, moves and agrees
    with ``/v1/status``; ``metrics.jsonl`` holds a line per step and the evaluation rewards."""
    env = {**os.environ, "AGENTJET_CACHE_DIR": str(CACHE), "AGENTJET_DIGITS": "3,8"}
    state = tmp_path / "state"
    args = ["--batch-groups", "2", "--group-size", "16", "--lr", "1e-3", "--state-dir", str(state)]
    server = ServerProcess(args, tmp_path / "server.log", env=env)
    url = server.url
    command = [str(BIN / "agentjet-client"), "run", "--code-dir", str(ROOT / "examples" / "digits")]
    command += ["--server", url, "--episodes", "1600", "--group-size", "16", "--concurrency", "16", "--seed", "0"]
    command += ["--eval-every", "10", "--eval-episodes", "32"]
    scrapes = []
    try:
        client = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        while client.poll() is None:
            scrapes.append(scrape(url))
            time.sleep(2.0)
        stdout, stderr = client.communicate(timeout=600)
        assert client.returncode == 0, stdout + stderr
        status = server.wait_trained()  # the learner takes the last batches after the client is done
        final = scrape(url)
    finally:
        server.stop()
    out = stdout.replace("\n", " ")
    assert "episodes" in out  # progress was printed
    first = float(re.search(r"first 10% ([0-9.]+)", out).group(1))
    last = float(re.search(r"last 20% ([0-9.]+)", out).group(1))
    counts = status["trajectories"]
    assert counts["accepted"] == 1600 and counts["rejected"] == 0 and status["policy_version"] >= 10
    assert last > first + 0.4, out

    # evaluation: recorded by policy version, never trained, and it rises with training
    rounds = [int(v) for v in re.findall(r"v(\d+): [0-9.]+ \(\d+\)", out.split("evaluation")[-1])]
    assert len(rounds) >= 3 and rounds[0] == 0, out
    history = [json.loads(line) for line in (state / "metrics.jsonl").read_text().splitlines()]
    evals: dict[int, list[float]] = {}
    for line in (x for x in history if x["kind"] == "eval"):
        evals.setdefault(line["policy_version"], []).append(line["reward"])
    assert counts["evaluated"] == sum(map(len, evals.values())) >= 3 * 32
    assert counts["trained"] == 1600  # every training episode, and not one evaluation episode
    by_version = sorted((v, sum(r) / len(r)) for v, r in evals.items() if len(r) >= 8)
    assert by_version[-1][1] > by_version[0][1] + 0.3, by_version
    steps = [x for x in history if x["kind"] == "step"]
    assert [x["step"] for x in steps] == list(range(1, status["learner"]["step"] + 1))
    assert all(x["loss"] is not None and x["entropy"] is not None and x["grad_norm"] >= 0 for x in steps)

    # /metrics moved during the run and agrees with /v1/status at the end
    assert len(scrapes) >= 5
    accepted = [s["agentjet_trajectories_total{outcome=accepted}"] for s in scrapes]
    assert accepted == sorted(accepted) and accepted[0] < accepted[-1]
    tokens = [s["agentjet_tokens_sampled_total"] for s in scrapes]
    assert tokens == sorted(tokens) and tokens[-1] > tokens[0]
    assert final["agentjet_trajectories_total{outcome=accepted}"] == counts["accepted"]
    assert final["agentjet_trajectories_total{outcome=evaluated}"] == counts["evaluated"]
    assert final["agentjet_trajectories_trained_total"] == counts["trained"]
    assert final["agentjet_learner_steps_total"] == status["learner"]["step"]
    assert final["agentjet_policy_version"] == status["policy_version"]
    assert final["agentjet_tokens_trained_total"] == sum(x["trained_tokens"] for x in steps)
    assert final["agentjet_engine_time_to_first_token_seconds_count"] > 1600
    assert final["agentjet_trained_token_version_lag_count"] == final["agentjet_tokens_trained_total"]
    assert final["agentjet_episode_reward_count{purpose=eval,tag=}"] == counts["evaluated"]
    clients = [k for k in final if k.startswith("agentjet_client_spool_depth{")]
    assert len(clients) == 1 and final[clients[0]] == 0  # one client, its spool drained
    print(out.split("done:")[-1], "\nevaluation by policy version:", by_version)


def test_learner_under_torchrun_with_two_ranks_trains_from_a_client_run(model_dir, tmp_path):
    """``torchrun --nproc_per_node 2 -m agentjet_server up``: rank 0 serves, both ranks train (FSDP2, gloo)."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    launcher += ["-m", "agentjet_server"]
    state = tmp_path / "state"
    # an entropy bonus gives a batch whose groups all tie a gradient too: every batch of 16 episodes steps
    args = ["--batch-groups", "2", "--group-size", "8", "--entropy-coef", "0.001", "--log-level", "info"]
    args += ["--state-dir", str(state)]
    server = ServerProcess(args, tmp_path / "server.log", env={"AGENTJET_DIGITS": "3,8"}, launcher=launcher)
    try:
        run_digits_client(server.url, 32, 8)
        # a live learning-rate change reaches both ranks before the next step (and survives --resume)
        r = httpx2.patch(server.url + "/v1/admin/config", json={"lr": 5e-4})
        assert r.status_code == 200, r.text
        run_digits_client(server.url, 32, 8)
        status = server.wait_trained()  # the learner takes the last batches after the client is done
        assert status["trajectories"]["accepted"] == 64 and status["trajectories"]["trained"] == 64
        assert status["learner"]["step"] == 4 and status["policy_version"] == 4, status["learner"]
        assert status["learner"]["last_error"] is None
    finally:
        server.stop()  # SIGTERM: rank 0 writes the last checkpoint, gathering rank 1's shards
    log = (tmp_path / "server.log").read_text()
    assert "learner rank 1 of 2" in log and "learner rank 1 waiting for batches" in log and "FSDP2" in log
    assert "learner rank 1 takes new settings (lr 0.0005)" in log
    step, version, skipped = status["learner"]["step"], status["policy_version"], status["learner"]["skipped_batches"]
    assert (state / "checkpoints" / f"step-{step:08d}" / "model" / "config.json").exists()

    # resume on 2 ranks: same version numbering, optimizer shards back on both ranks, training goes on
    server = ServerProcess([*args, "--resume"], tmp_path / "resumed.log", launcher=launcher)
    try:
        assert server.status()["policy_version"] == version
        assert httpx2.get(server.url + "/v1/admin/config").json()["config"]["lr"] == 5e-4
        run_digits_client(server.url, 32, 8)
        status = server.wait_trained()  # its last batches are trained after the client is done
        assert status["trajectories"]["accepted"] == 96 and status["learner"]["last_error"] is None
        learner = status["learner"]  # the two new batches stepped on both ranks, numbered on from the checkpoint
        assert learner["step"] == step + 2 and learner["skipped_batches"] == skipped == 0, learner
        assert status["policy_version"] - version == 2
    finally:
        server.stop()
    assert f"(step {step}, policy v{version})" in (tmp_path / "resumed.log").read_text()
