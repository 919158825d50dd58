"""vLLM serving the LoRA adapter the learner trains (``--engine vllm --lora-rank R``): each update
moves the adapter alone, a request keeps the adapter it started on (its tokens carry that
version), the log-probs equal the learner's merged model, a client run trains, and ``--resume``
serves the checkpoint's adapter on the base model."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import CACHE, ServerProcess

pytest.importorskip("vllm")
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]
ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
ASK = [{"role": "user", "content": "Say something."}]


def _adapted(model_dir: Path, seed: int):
    """A model with a random (non-zero) LoRA adapter, and the learner around it."""
    from transformers import AutoModelForCausalLM

    from agentjet_server.engine.adapter import LoraSpec
    from agentjet_server.learner.trainer import Learner, LearnerConfig

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    learner = Learner(model, LearnerConfig(lora=LoraSpec(rank=8, alpha=16.0)), pad_id=0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.normal_(0, 0.05)
    return learner


def test_vllm_serves_the_adapter_with_the_learners_logprobs_and_per_request_versions(chatty_model_dir):
    from agentjet_server.engine.adapter import LoraSpec
    from agentjet_server.engine.base import EngineOptions, SamplingParams
    from agentjet_server.engine.vllm import VLLMEngine

    engine = VLLMEngine(chatty_model_dir, EngineOptions(model_name="agentjet-tiny"), lora=LoraSpec(rank=8, alpha=16.0))
    try:
        assert engine.serves_adapters
        ids = engine.render(ASK)
        first, second = _adapted(chatty_model_dir, 1), _adapted(chatty_model_dir, 2)
        adapter = first.adapter_weights()
        assert all(".lora_" in name for name in adapter)  # the update is the adapter, not the model
        engine.update_adapter(adapter, 1)
        early: list = []
        late: list = []

        async def run() -> None:
            async def old_request() -> None:
                async for event in engine.generate(ids, SamplingParams(max_tokens=60, seed=3)):
                    early.append(event)
                    if len(early) == 5:
                        await asyncio.to_thread(engine.update_adapter, second.adapter_weights(), 2)

            await old_request()
            async for event in engine.generate(ids, SamplingParams(max_tokens=30, seed=4)):
                late.append(event)

        asyncio.run(run())
        # a request keeps the adapter it started on: all its tokens carry that version
        assert {e.version for e in early} == {1} and {e.version for e in late} == {2}
        for learner, events in ((first, early), (second, late)):
            seq = ids + [e.token_id for e in events]
            with torch.no_grad():
                logp = torch.log_softmax(learner.model(input_ids=torch.tensor([seq])).logits[0].float(), -1)
            expected = [float(logp[len(ids) - 1 + j, e.token_id]) for j, e in enumerate(events)]
            worst = max(abs(a - e.logprob) for a, e in zip(expected, events, strict=True))
            assert worst < 1e-3, f"vLLM's LoRA log-probs differ from the learner's by {worst}"
        assert [u.version for u in engine.updates][-2:] == [1, 2]
    finally:
        engine.close()


def test_two_adapters_on_one_vllm_engine_keep_their_own_versions_and_give_the_transformers_engines_tokens(
    chatty_model_dir,
):
    """``--adapters planner,executor`` on vLLM: each adapter's requests run on its own LoRA at its own version
    (mixed in one running batch), greedy tokens equal the transformers engine's serving the same adapters,
    and an update of one adapter leaves the other's tokens and version where they were."""
    from transformers import AutoModelForCausalLM

    from agentjet_server.engine.adapter import LoraSpec
    from agentjet_server.engine.base import EngineOptions, SamplingParams
    from agentjet_server.engine.hf import TransformersEngine
    from agentjet_server.engine.lora_layers import adapter_of, attach_adapters
    from agentjet_server.engine.vllm import VLLMEngine

    spec, names = LoraSpec(rank=8, alpha=16.0), ("planner", "executor")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(chatty_model_dir)
    attach_adapters(model, spec, names)

    def trained(name: str, scale: float) -> dict[str, torch.Tensor]:
        """Adapter ``name``'s tensors as a learner sends them, its B matrices moved off zero."""
        with torch.no_grad():
            out = {}
            for key, param in model.named_parameters():
                if adapter_of(key) == name:
                    if ".lora_B." in key:
                        param.normal_(0, scale)
                    out[key] = param.detach().clone()
        return out

    options = EngineOptions(model_name="agentjet-tiny", adapters=names, lora=spec)
    vllm, hf = VLLMEngine(chatty_model_dir, options), TransformersEngine(chatty_model_dir, options)
    try:
        assert vllm.adapters == names and hf.adapters == names
        ids = vllm.render(ASK)

        def greedy(engine, adapter: str) -> list:
            async def together() -> list:  # both adapters' requests in one running batch
                async def one(name: str) -> list:
                    params = SamplingParams(max_tokens=16, temperature=0.0, adapter=name)
                    return [e async for e in engine.generate(ids, params)]

                return await asyncio.gather(one("planner"), one("executor"))

            return dict(zip(names, asyncio.run(together()), strict=True))[adapter]

        def tokens(engine, adapter: str) -> tuple[list[int], set[int]]:
            events = greedy(engine, adapter)
            return [e.token_id for e in events], {e.version for e in events}

        base = tokens(vllm, "planner")[0]
        assert base == tokens(vllm, "executor")[0]  # fresh adapters (B = 0) are the base model
        tensors = trained("planner", 0.3)
        for engine in (vllm, hf):
            engine.update_named_adapter("planner", tensors, 1)
        planner, executor = tokens(vllm, "planner"), tokens(vllm, "executor")
        assert planner[1] == {1} and executor == (base, {0})
        assert planner[0] != base, "the planner's adapter should change its greedy answer"
        assert planner == tokens(hf, "planner") and executor == tokens(hf, "executor")
        for version in (1, 2):  # the executor moves twice; the planner stays at its one update
            tensors = trained("executor", 0.3)
            for engine in (vllm, hf):
                engine.update_named_adapter("executor", tensors, version)
        assert tokens(vllm, "executor")[1] == {2} and tokens(vllm, "planner") == planner
        assert tokens(vllm, "executor") == tokens(hf, "executor")
        assert vllm.adapter_version("executor") == 2 and vllm.adapter_version("planner") == 1
    finally:
        vllm.close()
        hf.close()


# a prompt the run trains on: how far the adapter moved the model is measured where it learned
# ("Say something." moved by 0.002-0.01 only, depending on the run: too close to call)
TRAINED_ASK = [{"role": "user", "content": "Write three as a digit."}]


def _probe_logprobs(url: str) -> tuple[list[int], list[int], list[float], list[int]]:
    import httpx2

    body = {"model": "agentjet-tiny", "messages": TRAINED_ASK, "max_tokens": 12, "seed": 5}
    reply = httpx2.post(url + "/v1/chat/completions", json=body, timeout=60).json()
    ext = reply["choices"][0]["agentjet"]
    return ext["prompt_token_ids"], ext["completion_token_ids"], ext["completion_logprobs"], ext["completion_versions"]


def _plain_logprobs(model_path: Path, prompt: list[int], completion: list[int]) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path)
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([prompt + completion])).logits[0].float(), -1)
    return [float(logp[len(prompt) - 1 + j, t]) for j, t in enumerate(completion)]


def test_a_client_run_trains_the_adapter_vllm_serves_and_resume_serves_it_again(model_dir, tmp_path):
    """Adapters on every linear layer (vLLM takes none on the output head): the run trains with an
    adapter update per step; after ``--resume`` vLLM, started from the base model, samples exactly
    what the checkpoint's merged model computes, at the checkpoint's version."""
    env = {**os.environ, "AGENTJET_CACHE_DIR": str(CACHE), "AGENTJET_DIGITS": "3,8"}
    state = tmp_path / "state"
    args = ["--engine", "vllm", "--lora-rank", "16", "--lora-alpha", "64", "--lr", "2e-3"]
    args += ["--batch-groups", "2", "--group-size", "16", "--state-dir", str(state), "--log-level", "info"]
    args += ["--entropy-coef", "0.001"]  # a batch whose groups all tie steps too: each batch an adapter update
    command = [str(BIN / "agentjet-client"), "run", "--code-dir", str(ROOT / "examples" / "digits")]
    command += ["--group-size", "16", "--concurrency", "16", "--seed", "0"]
    server = ServerProcess(args, tmp_path / "server.log", env=env)
    try:
        proc = subprocess.run(
            [*command, "--server", server.url, "--episodes", "320"], env=env, capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        status = server.wait_trained()
    finally:
        server.stop()
    out = proc.stdout.replace("\n", " ")
    first = float(re.search(r"first 10% ([0-9.]+)", out).group(1))  # type: ignore[union-attr]
    last = float(re.search(r"last 20% ([0-9.]+)", out).group(1))  # type: ignore[union-attr]
    print(f"vLLM serving the adapter, digits 3 and 8: first 10% {first:.3f} -> last 20% {last:.3f}")
    assert status["learner"]["last_error"] is None and status["policy_version"] == 10, status["learner"]
    version = status["policy_version"]
    checkpoint = sorted((state / "checkpoints").glob("step-*"))[-1]

    server = ServerProcess([*args, "--resume"], tmp_path / "resumed.log", env=env)
    try:
        assert server.status()["policy_version"] == version
        prompt, completion, logprobs, versions = _probe_logprobs(server.url)
    finally:
        server.stop()
    assert set(versions) == {version}
    assert f"vLLM serves LoRA adapter v{version} to new requests" in (tmp_path / "resumed.log").read_text()
    trained = _plain_logprobs(checkpoint / "model", prompt, completion)
    base = _plain_logprobs(model_dir, prompt, completion)
    assert max(abs(a - b) for a, b in zip(logprobs, trained, strict=True)) < 1e-3  # the checkpoint's adapter
    assert max(abs(a - b) for a, b in zip(logprobs, base, strict=True)) > 1e-2  # not the bare base model


def _greedy(url: str, model: str) -> tuple[list[int], list[int]]:
    import httpx2

    body = {"model": model, "messages": TRAINED_ASK, "max_tokens": 8, "temperature": 0}
    ext = httpx2.post(url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["agentjet"]
    return ext["completion_token_ids"], ext["completion_versions"]


def test_planner_and_executor_as_two_adapters_on_one_vllm_server_train_and_resume(tmp_path):
    """``--engine vllm --adapters planner,executor``: examples/planner_executor's two agents train their own
    adapters through vLLM's multi-LoRA, each at its own version; ``--resume`` serves both again, token for
    token, at the checkpoint's versions."""
    env = {**os.environ, "AGENTJET_CACHE_DIR": str(CACHE), "AGENTJET_DIGITS": "3,8"}
    state = tmp_path / "state"
    args = ["--engine", "vllm", "--lora-rank", "8", "--adapters", "planner,executor", "--lr", "2e-3"]
    args += ["--batch-groups", "2", "--group-size", "8", "--state-dir", str(state), "--log-level", "info"]
    command = [str(BIN / "agentjet-client"), "run", "--code-dir", str(ROOT / "examples" / "planner_executor")]
    command += ["--episodes", "96", "--group-size", "8", "--seed", "0", "--spool-dir", str(tmp_path / "spool")]
    server = ServerProcess(args, tmp_path / "server.log", env=env)
    try:
        proc = subprocess.run([*command, "--server", server.url], env=env, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        status = server.wait_trained()
        before = {name: _greedy(server.url, name) for name in ("planner", "executor")}
    finally:
        server.stop()
    versions = status["adapters"]
    assert versions["planner"] >= 2 and versions["executor"] >= 2 and status["learner"]["last_error"] is None
    for name, (_, tags) in before.items():
        assert set(tags) == {versions[name]}, f"{name}'s tokens carry {set(tags)}, its adapter is at {versions[name]}"
    log = (tmp_path / "server.log").read_text()
    assert f"vLLM serves adapter planner v{versions['planner']} to new requests" in log
    server = ServerProcess([*args, "--resume"], tmp_path / "resumed.log", env=env)
    try:
        assert server.status()["adapters"] == versions
        after = {name: _greedy(server.url, name) for name in ("planner", "executor")}
    finally:
        server.stop()
    assert after == before
