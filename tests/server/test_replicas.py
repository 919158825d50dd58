"""Engine replicas: routing with prefix affinity, weight fan-out with exact version tags, and a
replica killed mid-request (the request goes on elsewhere; the replica comes back)."""

import asyncio
import os
import signal
import time

import pytest
import torch

from agentjet_server.engine.base import SamplingParams
from agentjet_server.engine.replicas import ReplicaSet
from tests.server.test_engine import _plain_logprobs

PROMPT = [{"role": "user", "content": "Tell me something."}]


async def _drain(gen):
    return [event async for event in gen]


@pytest.fixture()
def replicas(chatty_model_dir):
    engine = ReplicaSet(
        "transformers", chatty_model_dir, replicas=2, devices=["cpu"], threads=1, model_name=None, max_batch=64
    )
    yield engine
    engine.close()


def test_requests_spread_over_replicas_and_an_update_reaches_every_one(replicas, chatty_model_dir):
    from transformers import AutoModelForCausalLM

    ids = replicas.render(PROMPT)

    async def burst(n, seed):
        jobs = [replicas.generate(ids, SamplingParams(max_tokens=24, seed=seed + i)) for i in range(n)]
        return await asyncio.gather(*[_drain(j) for j in jobs])

    outs = asyncio.run(burst(8, 0))
    assert all(len(o) == 24 and {e.version for e in o} == {0} for o in outs)
    before = [r["requests"] for r in replicas.replica_status()]
    assert all(n >= 2 for n in before), before  # both replicas served

    base = AutoModelForCausalLM.from_pretrained(chatty_model_dir).state_dict()
    model = AutoModelForCausalLM.from_pretrained(chatty_model_dir)
    # three updates: the shared-memory sets the updates take in turn are reused from the third on
    for version in (1, 2, 3):
        new = {k: v + 0.02 * torch.randn_like(v) for k, v in base.items()}
        replicas.update_weights(new, version)
        assert replicas.version == version and [r["version"] for r in replicas.replica_status()] == [version] * 2
        outs = asyncio.run(burst(8, 100 * version))
        after = [r["requests"] for r in replicas.replica_status()]
        assert all(a - b >= 2 for a, b in zip(after, before, strict=True)), (before, after)
        before = after
        assert all({e.version for e in o} == {version} for o in outs)  # whichever replica sampled them
        # and the new weights are the ones sampling: log-probs equal a plain forward pass with them
        model.load_state_dict(new)
        for out in outs:
            expected = _plain_logprobs(model, ids, out)
            assert max(abs(x - e.logprob) for x, e in zip(expected, out, strict=True)) < 1e-4


def test_hostile_sampling_settings_fail_their_own_request_only(replicas, chatty_model_dir):
    """The hostile settings of the fuzz suite with 32 ordinary requests, served by two replica processes."""
    from tests.conftest import LiveServer
    from tests.fuzz_requests import alongside_ordinary

    server = LiveServer(chatty_model_dir, engine=replicas, default_max_tokens=8)
    try:
        assert asyncio.run(alongside_ordinary(server.url, replicas.model_name)) == []
    finally:
        server.stop()


def test_the_calls_of_one_episode_follow_their_prefix(replicas):
    """Two episodes whose prompts grow turn by turn: each episode's calls stay on one replica,
    though the replicas are equally loaded (idle) at every call and the load tie-break alone
    would alternate them."""
    system = {"a": "You are terse. " * 6, "b": "Answer in one word, please. " * 4}
    history = {name: [{"role": "system", "content": system[name]}] for name in ("a", "b")}
    placed: dict[str, set[int]] = {"a": set(), "b": set()}

    async def turn(name, i):
        history[name].append({"role": "user", "content": f"Question {i} for episode {name}: " + name * 40})
        ids = replicas.render(history[name])
        before = [r["requests"] for r in replicas.replica_status()]
        out = await _drain(replicas.generate(ids, SamplingParams(max_tokens=8, seed=i)))
        after = [r["requests"] for r in replicas.replica_status()]
        placed[name].add(next(k for k in range(2) if after[k] > before[k]))
        history[name].append({"role": "assistant", "content": replicas.decode([e.token_id for e in out])})

    async def run():
        for i in range(4):
            for name in ("a", "b"):
                await turn(name, i)

    asyncio.run(run())
    assert len(placed["a"]) == 1 and len(placed["b"]) == 1, placed
    assert placed["a"] != placed["b"]  # b's first call went to the replica holding nothing of it


def test_a_replica_killed_mid_request_is_restarted_and_the_request_finishes(replicas, chatty_model_dir):
    from transformers import AutoModelForCausalLM

    new = {k: v + 0.01 for k, v in AutoModelForCausalLM.from_pretrained(chatty_model_dir).state_dict().items()}
    replicas.update_weights(new, 3)
    ids = replicas.render(PROMPT)
    killed: list[int] = []

    async def run():
        events = []
        async for event in replicas.generate(ids, SamplingParams(max_tokens=400, seed=1)):
            events.append(event)
            if len(events) == 20:
                busy = next(r for r in replicas.replica_status() if r["in_flight"] == 1)
                killed.append(busy["index"])
                os.kill(busy["pid"], signal.SIGKILL)
        return events

    events = asyncio.run(run())
    assert len(events) == 400 and events[-1].finish_reason == "length"
    assert {e.version for e in events} == {3}
    status = replicas.replica_status()
    assert status[killed[0]]["failovers"] == 1
    deadline = time.monotonic() + 120
    while replicas.replica_status()[killed[0]]["state"] != "ready":
        assert time.monotonic() < deadline, replicas.replica_status()
        time.sleep(0.2)
    back = replicas.replica_status()[killed[0]]
    assert back["restarts"] == 1 and back["version"] == 3  # it came back with the newest weights


def test_replica_layouts_that_cannot_work_are_refused_with_what_to_pass():
    from agentjet_server.settings import ServerSettings

    with pytest.raises(ValueError, match="one per replica"):
        ServerSettings(engine_devices="cuda:0,cuda:1")
    with pytest.raises(ValueError, match="each replica needs a device of its own"):
        ServerSettings(engine_replicas=2, device="cuda")
    with pytest.raises(ValueError, match="needs --engine vllm"):
        ServerSettings(tensor_parallel_size=2)
    ok = ServerSettings(engine_replicas=2, engine_devices="cuda:0,cuda:1", engine="vllm")
    assert ok.engine_device_list() == ["cuda:0", "cuda:1"] and ok.engine_device == "cuda:0"
    assert ServerSettings(engine_replicas=3).engine_device_list() == ["cpu"]  # CPU replicas share it


def test_the_memory_plan_counts_each_cpu_replica(model_dir):
    from agentjet_server.memory import Layout, plan
    from agentjet_server.model_shape import ModelShape

    shape = ModelShape.from_pretrained(model_dir)
    one, three = (plan(shape, Layout(engine_replicas=n), {"cpu": 64 << 30}) for n in (1, 3))
    engine = [i for i in one.devices[0].items if i.name.startswith("engine")]
    engine3 = [i for i in three.devices[0].items if i.name.startswith("engine")]
    assert sum(i.bytes for i in engine3) == 3 * sum(i.bytes for i in engine)
    assert three.devices[0].total > one.devices[0].total + 2 * sum(i.bytes for i in engine)
    # and the fan-out's shared memory: two sets of the weights in the engines' dtype
    fanout = [i.bytes for i in three.devices[0].items if i.name == "weights fan-out"]
    assert fanout == [2 * shape.parameters * 4] and not any(i.name == "weights fan-out" for i in one.devices[0].items)
