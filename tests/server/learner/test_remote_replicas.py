"""Engine replicas on other ranks (``engine.remote_replicas`` with ``learner.distributed``): 2 gloo processes under
torchrun, an engine replica hosted by rank 1. Each published version reaches it with the right version number (its
tokens are tagged with it), and its greedy tokens equal rank 0's own engine's with the same weights."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from agentjet_server.learner.distributed import _buckets

SCRIPT = Path(__file__).with_name("remote_replica.py")


def test_weights_cross_in_buckets_of_one_dtype():
    specs = (("a", (4, 4), "float32"), ("b", (8,), "float32"), ("c", (2,), "bfloat16"), ("d", (3,), "float32"))
    assert [[name for name, _, _ in bucket] for bucket in _buckets(specs)] == [["a", "b"], ["c"], ["d"]]


@pytest.fixture(scope="module")
def report(model_dir: Path) -> dict:  # type: ignore[type-arg]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    command += [str(SCRIPT), "--model", str(model_dir)]
    proc = subprocess.run(
        command, capture_output=True, text=True, timeout=600, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"}
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_every_update_reaches_the_replica_on_the_other_rank_with_its_version(report):
    for update in report["updates"]:
        version = update["version"]
        assert update["engine"] == version
        for side in ("local", "remote", "routed"):
            tokens, versions = update[side]
            assert tokens and set(versions) == {version}, (side, update)
    remote = report["status"][1]
    assert remote["device"].startswith("remote 127.0.0.1:") and remote["version"] == 3


def test_greedy_tokens_equal_the_first_replicas(report):
    for update in report["updates"]:
        assert update["remote"][0] == update["local"][0], update
    # the weights changed the answer: equal tokens are not the base model's on both sides
    answers = {tuple(update["local"][0]) for update in report["updates"]}
    assert len(answers) > 1
