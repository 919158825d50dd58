"""A swarm run and a Tinker client train on one server at the same time: ``agentjet-client run`` (a real
process, the digits example's OpenAI-SDK agent captured token by token) trains the served model through the
learner while a Tinker LoRA client (the real SDK) trains an adapter on the Tinker API's own frozen copy of the
base. Each learns, and neither moves the other's weights."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import CACHE, LiveServer
from tests.server.api.test_tinker import MODEL, data_of, loss_per_token, step

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
EPISODES = 640
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning", "ignore::ResourceWarning"),
]


def wait_for(condition, what: str, limit: float = 180.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def logprobs(outputs) -> list[np.ndarray]:  # type: ignore[no-untyped-def]
    return [out["logprobs"].to_numpy() for out in outputs]


def test_a_swarm_run_and_a_tinker_client_train_side_by_side(model_dir, tmp_path):
    live = LiveServer(model_dir, group_size=8, batch_groups=2, lr=1e-3, state_dir=tmp_path / "state")
    initial = {k: v.clone() for k, v in live.runtime.loop.learner.full_state_dict().items()}
    env = {**os.environ, "AGENTJET_CACHE_DIR": str(CACHE), "AGENTJET_DIGITS": "3,8"}
    command = [str(BIN / "agentjet-client"), "run", "--code-dir", str(ROOT / "examples" / "digits")]
    command += ["--server", live.url, "--episodes", str(EPISODES), "--group-size", "8", "--concurrency", "8"]
    command += ["--seed", "0"]
    swarm = None
    try:
        with tinker.ServiceClient(base_url=live.url, api_key="tml-any") as service:
            client = service.create_lora_training_client(base_model=MODEL, rank=16, seed=0).result()
            data = data_of(client.get_tokenizer())
            base = service.create_sampling_client(base_model=MODEL).result()
            probe = types.ModelInput.from_ints(data[0].model_input.to_ints())
            base_before = base.compute_logprobs(probe).result()
            before = loss_per_token(client, data)

            swarm = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            wait_for(lambda: live.runtime.version >= 1, "the swarm run's first step")
            # the swarm steps and the Tinker client's adapter does not move
            mine = logprobs(client.forward(data, "cross_entropy").result().loss_fn_outputs)
            moved_to = live.runtime.version + 2
            wait_for(lambda: live.runtime.version >= moved_to, "two more swarm steps")
            again = logprobs(client.forward(data, "cross_entropy").result().loss_fn_outputs)
            assert all(np.array_equal(a, b) for a, b in zip(mine, again, strict=True))

            # the Tinker client trains while the swarm goes on
            started = live.runtime.version
            for _ in range(30):
                step(client, data, lr=1e-2)
            during = live.runtime.version - started
            after = loss_per_token(client, data)
            output, _ = swarm.communicate(timeout=600)
            assert swarm.returncode == 0, output[-3000:]
            assert base.compute_logprobs(probe).result() == base_before  # the Tinker API's base: unmoved
    finally:
        if swarm is not None and swarm.poll() is None:
            swarm.kill()
        live.stop()
    status = live.runtime.status()
    served = live.runtime.loop.learner.full_state_dict()
    moved = max(float((served[k] - initial[k]).abs().max()) for k in initial)
    print(
        f"side by side: the Tinker client's loss {before:.3f} -> {after:.3f} in 30 steps, while the swarm took "
        f"{during} steps; the swarm's policy v{status.policy_version}, its weights moved by up to {moved:.3g}"
    )
    assert after < before * 2 / 3, (before, after)
    assert during >= 1  # the two trained at the same time
    assert status.trajectories.accepted == EPISODES and status.policy_version >= 10
    assert moved > 1e-3  # the served model trained
