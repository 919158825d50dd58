"""End to end with ``--lora-rank``: a client run on the demo task trains an adapter, and the
checkpoint's adapter (peft's format) on the base model equals the checkpoint's merged model."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import CACHE, ServerProcess

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent

pytestmark = pytest.mark.e2e


def test_a_lora_adapter_learns_the_demo_task_and_its_checkpoint_loads_in_peft(model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    env = {**os.environ, "AGENTJET_CACHE_DIR": str(CACHE), "AGENTJET_DIGITS": "3,8"}
    state = tmp_path / "state"
    args = ["--lora-rank", "8", "--lora-targets", "all-linear,lm_head", "--lr", "1.5e-3"]
    args += ["--batch-groups", "2", "--group-size", "16", "--state-dir", str(state)]
    server = ServerProcess(args, tmp_path / "server.log", env=env)
    command = [str(BIN / "agentjet-client"), "run", "--code-dir", str(ROOT / "examples" / "digits")]
    command += ["--server", server.url, "--episodes", "4800", "--group-size", "16", "--concurrency", "16"]
    command += ["--seed", "0"]
    try:
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        status = server.wait_trained()
    finally:
        server.stop()  # writes the last checkpoint
    out = proc.stdout.replace("\n", " ")
    first = float(re.search(r"first 10% ([0-9.]+)", out).group(1))  # type: ignore[union-attr]
    last = float(re.search(r"last 20% ([0-9.]+)", out).group(1))  # type: ignore[union-attr]
    print(f"LoRA rank 8 on the demo task (digits 3, 8): first 10% {first:.3f} -> last 20% {last:.3f}")
    # 9 runs of 13 (lr 1.5e-3 and 3e-3) reach 0.99+; in the others one prompt collapses early onto a
    # wrong digit, its groups then all earn 0 and give GRPO no signal, and the run ends at 0.50 (the
    # other prompt solved). Both are learning from chance (about 0.1); 0.3 above the start holds both.
    assert last > first + 0.3 and status["trajectories"]["accepted"] == 4800, out[-2000:]

    checkpoint = sorted((state / "checkpoints").glob("step-*"))[-1]
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    adapted = PeftModel.from_pretrained(base, str(checkpoint / "adapter"))
    plain = AutoModelForCausalLM.from_pretrained(checkpoint / "model")
    ids = torch.tensor([[1, 415, 201, 926, 773, 400, 268, 648, 16, 2, 201, 1, 418, 201]])
    with torch.no_grad():
        a, b = adapted(input_ids=ids).logits, plain(input_ids=ids).logits
        untrained = AutoModelForCausalLM.from_pretrained(model_dir)(input_ids=ids).logits
    assert float((a - b).abs().max()) < 1e-4  # the adapter on the base is the merged model
    assert float((a - untrained).abs().max()) > 0.1  # and it did change the model
