"""``--engine-replicas 2 --engine vllm --engine-sleep``: the replicas end-to-end test of
tests/e2e/test_replicas.py with two vLLM engine processes that sleep through every step (runs in
the vLLM suite's environment; replicas without sleep are the transformers run of the same test)."""

import pytest

from tests.e2e.test_replicas import run_with_replicas

pytest.importorskip("vllm")
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.e2e,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


def test_two_sleeping_vllm_replicas_train_and_survive_a_kill(model_dir, tmp_path):
    run_with_replicas(tmp_path, "vllm", sleep=True)
