"""An adapter per agent, served and trained by one server (``--lora-rank R --adapters planner,executor``).

The transformers engine samples every request with its agent's adapter, rows of different adapters in one
forward pass (peft's mixed-adapter batches) giving what each adapter alone gives; each token is tagged with
its adapter's own version. Through the API: a call is routed by its model name, else its agent; the learner
trains each adapter on its own turns only, so a batch of planner turns moves the planner's adapter and
version and leaves the executor's weights (in the engine too) and version as they were.
"""

from __future__ import annotations

import asyncio
import time

import httpx2
import pytest
import torch

from agentjet_client import SwarmClient
from agentjet_server.engine.adapter import LoraSpec
from agentjet_server.engine.base import EngineOptions, SamplingParams
from agentjet_server.engine.hf import TransformersEngine
from agentjet_server.engine.lora_layers import adapter_of
from agentjet_server.errors import EngineError
from tests.conftest import LiveServer

SPEC = LoraSpec(rank=4, alpha=8.0)
NAMES = ("planner", "executor")
PROMPTS = [[1, 5, 9, 40, 77, 3], [1, 12, 30, 31], [1, 7, 7, 60, 61, 62, 63]]


def adapter_engine(model_dir, **options):  # type: ignore[no-untyped-def]
    return TransformersEngine(model_dir, EngineOptions(adapters=NAMES, lora=SPEC, **options))


def random_adapter(engine: TransformersEngine, name: str, seed: int) -> dict[str, torch.Tensor]:
    """Weights for adapter ``name`` large enough to change the greedy answers, under the learner's names."""
    generator = torch.Generator().manual_seed(seed)
    return {
        key: torch.randn(p.shape, generator=generator) * 0.5
        for key, p in engine.model.named_parameters()
        if adapter_of(key) == name
    }


async def sample(
    engine: TransformersEngine, prompt: list[int], adapter: str | None
) -> tuple[list[int], list[float], list[int]]:
    params = SamplingParams(max_tokens=8, temperature=0.0, adapter=adapter)
    events = [e async for e in engine.generate(prompt, params)]
    return [e.token_id for e in events], [e.logprob for e in events], [e.version for e in events]


def test_a_mixed_batch_gives_each_row_its_adapters_answer_and_version(model_dir):
    engine = adapter_engine(model_dir)
    try:
        engine.update_named_adapter("planner", random_adapter(engine, "planner", 1), 3)
        engine.update_named_adapter("executor", random_adapter(engine, "executor", 2), 1)
        jobs = [(prompt, name) for prompt in PROMPTS for name in NAMES]

        async def alone() -> list:  # type: ignore[type-arg]
            return [await sample(engine, prompt, name) for prompt, name in jobs]

        async def together() -> list:  # type: ignore[type-arg]
            return list(await asyncio.gather(*(sample(engine, prompt, name) for prompt, name in jobs)))

        one_by_one, mixed = asyncio.run(alone()), asyncio.run(together())
        assert engine.largest_batch >= 2  # the gathered requests did share forward passes
        for (prompt, name), single, shared in zip(jobs, one_by_one, mixed, strict=True):
            assert single[0] == shared[0], (prompt, name)
            assert shared[1] == pytest.approx(single[1], abs=1e-4)
            assert set(shared[2]) == {3 if name == "planner" else 1}
        # the adapters do differ: the same prompt, another answer (else this test would prove nothing)
        assert any(one_by_one[2 * i][0] != one_by_one[2 * i + 1][0] for i in range(len(PROMPTS)))
        # an update of one adapter retags its rows alone
        engine.update_named_adapter("executor", random_adapter(engine, "executor", 2), 2)
        assert asyncio.run(sample(engine, PROMPTS[0], "planner"))[2] == [3] * len(one_by_one[0][2])
        assert set(asyncio.run(sample(engine, PROMPTS[0], "executor"))[2]) == {2}
        with pytest.raises(EngineError, match="no adapter 'critic'"):
            asyncio.run(sample(engine, PROMPTS[0], "critic"))
        with pytest.raises(ValueError, match="tensors that are not its"):
            engine.update_named_adapter("planner", random_adapter(engine, "executor", 2), 4)
    finally:
        engine.close()


@pytest.fixture(scope="module")
def adapter_server(model_dir):  # type: ignore[no-untyped-def]
    server = LiveServer(
        model_dir,
        engine=adapter_engine(model_dir),
        lora_rank=4,
        lora_alpha=8.0,
        adapters="planner,executor",
        batch_groups=1,
        group_size=2,
        lr=5e-3,
    )
    yield server
    server.stop()


def test_calls_are_routed_to_their_adapter_and_a_planner_batch_trains_the_planner_alone(adapter_server):
    url = adapter_server.url
    cards = httpx2.get(url + "/v1/models").json()["data"]
    assert [m["id"] for m in cards] == ["agentjet-tiny", "planner", "executor"]
    assert all(abs(m["created"] - time.time()) < 600 for m in cards)  # Unix time: when the server started
    ask = [{"role": "user", "content": "Write two as a digit."}]
    by_model = httpx2.post(
        url + "/v1/chat/completions", json={"model": "executor", "messages": ask, "max_tokens": 4}
    ).json()
    assert by_model["choices"][0]["agentjet"]["adapter"] == "executor"
    nowhere = httpx2.post(url + "/v1/chat/completions", json={"messages": ask, "max_tokens": 4})
    assert nowhere.status_code == 400 and nowhere.json()["error"]["code"] == "adapter_not_found"
    assert "planner, executor" in nowhere.json()["error"]["message"]

    engine = adapter_server.engine
    executor_before = {k: v.clone() for k, v in engine.model.named_parameters() if adapter_of(k) == "executor"}
    planner_before = {k: v.clone() for k, v in engine.model.named_parameters() if adapter_of(k) == "planner"}
    with SwarmClient(url) as client:
        trajectories = []
        for reward in (1.0, 0.0):
            episode = client.episode("plan-1")
            llm = episode.openai(agent="planner")
            llm.chat.completions.create(model="agentjet-tiny", messages=ask, max_tokens=6, temperature=1.0)
            episode.close()
            trajectories.append(episode.to_trajectory(reward))
        assert all(t.adapter == "planner" for tr in trajectories for t in tr.turns)
        assert [r.status for r in client.submit(trajectories).results] == ["accepted", "accepted"]
        status = wait_for_step(url)
    assert status["adapters"] == {"planner": 1, "executor": 0} and status["policy_version"] == 1
    after = dict(engine.model.named_parameters())
    assert all(torch.equal(after[k], v) for k, v in executor_before.items())  # served as it was
    assert any(not torch.equal(after[k], v) for k, v in planner_before.items())  # the planner's new weights
    learner = adapter_server.runtime.loop.trainer
    planner_now = learner.adapter_weights("planner")
    assert all(torch.equal(planner_now[k], after[k].detach().cpu()) for k in planner_now)
    answer = httpx2.post(url + "/v1/chat/completions", json={"model": "planner", "messages": ask, "max_tokens": 3})
    assert set(answer.json()["choices"][0]["agentjet"]["completion_versions"]) == {1}
    executor = httpx2.post(url + "/v1/chat/completions", json={"model": "executor", "messages": ask, "max_tokens": 3})
    assert set(executor.json()["choices"][0]["agentjet"]["completion_versions"]) == {0}


def test_turns_of_an_adapter_the_server_lacks_or_of_none_are_refused(adapter_server):
    with SwarmClient(adapter_server.url) as client:
        episode = client.episode("refused")
        llm = episode.openai(agent="executor")
        llm.chat.completions.create(model="agentjet-tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
        episode.close()
        good = episode.to_trajectory(1.0)
        turn = good.turns[0]
        foreign = good.model_copy(update={"id": "foreign", "turns": [turn.model_copy(update={"adapter": "critic"})]})
        bare = good.model_copy(update={"id": "bare", "turns": [turn.model_copy(update={"adapter": None})]})
        results = client.submit([foreign, bare]).results
    assert [r.status for r in results] == ["rejected", "rejected"]
    assert "adapter 'critic'" in results[0].reason and "planner, executor" in results[0].reason
    assert "names no adapter" in results[1].reason


def wait_for_step(url: str, limit: float = 60) -> dict:  # type: ignore[type-arg]
    deadline = time.monotonic() + limit
    while True:
        status = httpx2.get(url + "/v1/status").json()
        if status["trajectories"]["trained"] >= status["trajectories"]["accepted"] > 0:
            return status  # type: ignore[no-any-return]
        assert time.monotonic() < deadline, status
        time.sleep(0.1)


def test_adapters_survive_a_restart_with_their_versions_and_weights(model_dir, tmp_path):
    """A planner step, a clean stop (its checkpoint holds each adapter in peft's format) and ``--resume``:
    the adapters come back at their versions, and the planner answers token for token as before."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.conftest import ServerProcess

    state = tmp_path / "state"
    args = ["--lora-rank", "4", "--adapters", "planner,executor", "--batch-groups", "1", "--group-size", "2"]
    args += ["--lr", "5e-3", "--state-dir", str(state)]
    ask = {"model": "planner", "messages": [{"role": "user", "content": "Write two as a digit."}], "max_tokens": 5}
    ask["temperature"] = 0.0
    server = ServerProcess(args, tmp_path / "server.log")
    try:
        with SwarmClient(server.url) as client:
            trajectories = []
            for reward in (1.0, 0.0):
                episode = client.episode("plan")
                episode.openai(agent="planner").chat.completions.create(
                    model="agentjet-tiny", messages=ask["messages"], max_tokens=6
                )
                episode.close()
                trajectories.append(episode.to_trajectory(reward))
            assert [r.status for r in client.submit(trajectories).results] == ["accepted", "accepted"]
        assert server.wait_trained()["adapters"] == {"planner": 1, "executor": 0}
        before = httpx2.post(server.url + "/v1/chat/completions", json=ask).json()["choices"][0]["agentjet"]
    finally:
        server.stop()
    [checkpoint] = sorted((state / "checkpoints").glob("step-*"))
    for name in NAMES:  # each adapter alone, as peft loads it
        base = AutoModelForCausalLM.from_pretrained(checkpoint / "model")
        assert isinstance(PeftModel.from_pretrained(base, checkpoint / "adapters" / name), PeftModel)
    again = ServerProcess([*args, "--resume"], tmp_path / "again.log")
    try:
        assert again.status()["adapters"] == {"planner": 1, "executor": 0}
        after = httpx2.post(again.url + "/v1/chat/completions", json=ask).json()["choices"][0]["agentjet"]
        executor = {**ask, "model": "executor"}
        served = httpx2.post(again.url + "/v1/chat/completions", json=executor).json()["choices"][0]["agentjet"]
    finally:
        again.stop()
    assert after["completion_token_ids"] == before["completion_token_ids"]
    assert after["completion_logprobs"] == pytest.approx(before["completion_logprobs"], abs=1e-5)
    assert set(after["completion_versions"]) == {1} and set(served["completion_versions"]) == {0}


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"adapters": "planner,executor"}, "add --lora-rank R"),
        ({"lora_rank": 4, "adapters": "planner,planner"}, "names must be distinct"),
        ({"lora_rank": 4, "adapters": "default,executor"}, "not 'default'"),
        ({"lora_rank": 4, "adapters": "a b"}, "names must be distinct agent names"),
        ({"lora_rank": 4, "adapters": " , "}, "names no adapter"),
        ({"lora_rank": 4, "adapters": "p,e", "engine_replicas": 2}, "not with --engine-replicas 2"),
        ({"lora_rank": 4, "engine": "vllm", "lora_targets": "all-linear,lm_head"}, "vLLM serves no LoRA on the output"),
        ({"lora_rank": 4, "adapters": "p,e", "algorithm": "ppo"}, "not with --algorithm ppo"),
    ],
)
def test_adapter_settings_that_cannot_work_are_refused_with_what_to_do(settings, message):
    from pydantic import ValidationError

    from agentjet_server.settings import ServerSettings

    with pytest.raises(ValidationError, match=message):
        ServerSettings(**settings)
