"""``--engine-sleep``: vLLM sleeps through each learner step (level 1: KV cache freed, weights to host
memory) and wakes with the new weights. On CPU vLLM frees nothing (sleep is a GPU feature), but the
rest is the same and is what these tests check: sampling stops while asleep, requests that arrive
wait and then run on the new weights, requests in flight are preempted and resume, every token is
tagged with the weights that produced it, and the weights loaded on waking are the learner's.
``tests/gpu/test_cuda.py`` checks the memory it frees on a GPU (with the official vLLM wheel).
"""

from __future__ import annotations

import json
import sys
import threading
import time

import openai
import pytest

from tests.conftest import ServerProcess, run_digits_client
from tests.vllm.test_vllm_engine import ASK, _group, _push, _wait_version, learner_logprob_gap

pytest.importorskip("vllm")
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


@pytest.fixture(scope="module")
def sleepy_server(chatty_model_dir):
    """The random-weights model (it rambles to ``max_tokens``) on a vLLM engine with sleep mode."""
    from agentjet_server.engine.base import EngineOptions
    from agentjet_server.engine.vllm import VLLMEngine
    from tests.conftest import LiveServer

    engine = VLLMEngine(chatty_model_dir, EngineOptions(model_name="agentjet-tiny"), sleep_mode=True)
    server = LiveServer(chatty_model_dir, engine=engine, batch_groups=1, group_size=2, max_staleness=8)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def sdk(sleepy_server):
    with openai.OpenAI(base_url=sleepy_server.url + "/v1", api_key="unused") as client:
        yield client


class Stream(threading.Thread):
    """A streamed completion in a thread, counting its chunks with text as they arrive."""

    def __init__(self, url: str, max_tokens: int, seed: int) -> None:
        super().__init__(daemon=True)
        self.url, self.max_tokens, self.seed = url, max_tokens, seed
        self.chunks = 0
        self.result: dict | None = None

    def run(self) -> None:
        with openai.OpenAI(base_url=self.url + "/v1", api_key="unused") as client:
            for chunk in client.chat.completions.create(
                model="agentjet-tiny", messages=ASK, max_tokens=self.max_tokens, seed=self.seed, stream=True
            ):
                for choice in chunk.choices:
                    if choice.delta.content or choice.finish_reason:  # not the opening (role) chunk
                        self.chunks += 1
                    if choice.finish_reason:
                        self.result = {"finish": choice.finish_reason, **choice.model_extra["agentjet"]}


def _wait(condition, limit: float = 60) -> None:
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def _tokens(sdk, max_tokens: int, seed: int) -> list[int]:
    reply = sdk.chat.completions.create(model="agentjet-tiny", messages=ASK, max_tokens=max_tokens, seed=seed)
    return reply.choices[0].model_extra["agentjet"]["completion_token_ids"]


def test_nothing_is_sampled_while_asleep_and_every_request_finishes_after_waking(sleepy_server, sdk):
    engine = sleepy_server.engine
    version = sleepy_server.runtime.version
    # the same seeded requests, never interrupted: a preempted request resumes exactly where it was
    expected = {1: _tokens(sdk, 400, 1), 2: _tokens(sdk, 8, 2)}
    assert len(expected[1]) > 100  # it runs long enough to be caught in flight
    running = Stream(sleepy_server.url, 400, seed=1)
    running.start()
    _wait(lambda: running.chunks >= 5)
    engine.sleep()
    assert engine.asleep
    arriving = Stream(sleepy_server.url, 8, seed=2)
    arriving.start()
    time.sleep(0.3)  # tokens sampled before the sleep may still be on their way
    seen = running.chunks
    time.sleep(1.0)
    assert running.chunks == seen and running.result is None, "tokens were sampled while asleep"
    assert arriving.chunks == 0 and arriving.result is None
    engine.wake()
    assert not engine.asleep
    for seed, stream in ((1, running), (2, arriving)):
        stream.join(timeout=120)
        assert stream.result is not None
        assert stream.result["completion_token_ids"] == expected[seed]
        assert set(stream.result["completion_versions"]) == {version}  # no update: the same weights throughout
    assert seen < len(expected[1])  # it was caught in flight, and went on after waking
    assert engine.sleeps[-1][0] > 0 and engine.sleeps[-1][1] > 0


def test_each_step_sleeps_the_engine_and_it_wakes_with_the_learners_weights(sleepy_server, sdk):
    engine = sleepy_server.engine
    start = sleepy_server.runtime.version
    slept = len(engine.sleeps)
    streams = [Stream(sleepy_server.url, 400, seed=10 + i) for i in range(4)]
    for stream in streams:
        stream.start()
    _wait(lambda: all(s.chunks >= 3 for s in streams))
    _push(sleepy_server.url, _group(sdk, "asleep", max_tokens=4))
    version = _wait_version(sleepy_server, start)
    for stream in streams:
        stream.join(timeout=120)
    assert len(engine.sleeps) == slept + 1, "the step did not put the engine to sleep"
    switched = 0
    for stream in streams:
        r = stream.result
        assert r is not None and len(r["completion_versions"]) == len(r["completion_token_ids"]) > 0
        assert r["completion_versions"] == sorted(r["completion_versions"])  # never back to older weights
        switched += r["completion_versions"][0] < r["completion_versions"][-1]
    assert switched >= 1, "no stream was in flight across the step"
    # what the woken engine samples with is exactly the learner's new weights
    reply = sdk.chat.completions.create(model="agentjet-tiny", messages=ASK, max_tokens=40, seed=21)
    ext = reply.choices[0].model_extra["agentjet"]
    assert set(ext["completion_versions"]) == {version}
    worst = learner_logprob_gap(sleepy_server, ext)
    assert worst < 1e-3, f"vLLM logprobs after waking differ from the learner's weights by {worst}"


@pytest.mark.e2e
def test_torchrun_learner_ranks_with_a_sleeping_vllm_in_its_own_process(model_dir, tmp_path):
    """``--engine-sleep`` under torchrun: vLLM runs in a spawned process, put to sleep and woken over
    its pipe around every step of 2 FSDP2 ranks."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    launcher += ["-m", "agentjet_server"]
    state = tmp_path / "state"
    args = ["--engine", "vllm", "--engine-sleep", "--batch-groups", "2", "--group-size", "8", "--state-dir", str(state)]
    args += ["--entropy-coef", "0.001"]  # a batch whose groups all tie steps too: three batches, three steps
    server = ServerProcess(args, tmp_path / "server.log", env={"AGENTJET_DIGITS": "3,8"}, launcher=launcher)
    try:
        run_digits_client(server.url, 48, 8)
        status = server.wait_trained()
        assert status["trajectories"]["accepted"] == 48
        assert status["policy_version"] == 3 and status["learner"]["last_error"] is None, status["learner"]
        with openai.OpenAI(base_url=server.url + "/v1", api_key="unused") as sdk:
            reply = sdk.chat.completions.create(model="agentjet-tiny", messages=ASK, max_tokens=4)
        assert set(reply.choices[0].model_extra["agentjet"]["completion_versions"]) == {status["policy_version"]}
    finally:
        server.stop()
    steps = [json.loads(line) for line in (state / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if s["kind"] == "step"]
    assert len(steps) == status["policy_version"]
    assert all(s["engine_sleep_seconds"] > 0 for s in steps), steps[0]


def test_sleeping_replicas_hold_their_requests_the_awake_one_serves_and_a_dead_sleeper_waits_for_the_step(
    chatty_model_dir,
):
    """``--engine-sleep --engine-replicas 2`` with replica 0 on the learner's device (it sleeps)
    and replica 1 on a device of its own (it serves on): while 0 sleeps every request goes to 1;
    a request 0 was sampling is preempted and resumes after waking; 0 killed while asleep is
    started again only once the step is over, with the newest weights."""
    import asyncio
    import os
    import signal

    from transformers import AutoModelForCausalLM

    from agentjet_server.engine.base import SamplingParams
    from agentjet_server.engine.replicas import ReplicaSet

    engine = ReplicaSet(
        "vllm", chatty_model_dir, replicas=2, devices=["cpu"], threads=1, model_name=None, max_batch=64, sleepers=[0]
    )
    try:
        assert engine.can_sleep and [r["sleeps"] for r in engine.replica_status()] == [True, False]
        ids = engine.render(ASK)

        async def drain(seed: int, max_tokens: int, started: asyncio.Event | None = None) -> list:
            out = []
            async for event in engine.generate(ids, SamplingParams(max_tokens=max_tokens, seed=seed)):
                out.append(event)
                if started is not None and len(out) == 5:
                    started.set()
            return out

        async def across_a_sleep() -> tuple[list, list[list], list[int]]:
            started = asyncio.Event()
            long = asyncio.create_task(drain(1, 300, started))  # idle replicas: it goes to replica 0
            await started.wait()
            assert [r["in_flight"] for r in engine.replica_status()] == [1, 0]
            await asyncio.to_thread(engine.sleep)
            assert [r["asleep"] for r in engine.replica_status()] == [True, False]
            served = [r["requests"] for r in engine.replica_status()]
            during = await asyncio.gather(*(drain(10 + i, 6) for i in range(4)))  # finish while 0 sleeps
            after = [r["requests"] for r in engine.replica_status()]
            assert not long.done(), "replica 0 sampled while asleep"
            await asyncio.to_thread(engine.wake)
            return await long, during, [a - b for a, b in zip(after, served, strict=True)]

        long, during, routed = asyncio.run(across_a_sleep())
        assert routed == [0, 4], routed  # every request went to the awake replica
        assert all(len(d) == 6 for d in during) and len(long) == 300
        # a sleeper that dies during the step comes back after it, with the step's weights
        engine.sleep()
        victim = engine.replica_status()[0]["pid"]
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while engine.replicas[0].engine.alive:  # type: ignore[union-attr]
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert len(asyncio.run(drain(20, 4))) == 4  # replica 1 serves it, and the router sees 0 dead
        assert engine.replica_status()[0]["state"] == "restarting"
        time.sleep(3)
        assert engine.replica_status()[0]["pid"] == victim  # not started while the learner steps
        new = {k: v + 0.01 for k, v in AutoModelForCausalLM.from_pretrained(chatty_model_dir).state_dict().items()}
        engine.update_weights(new, 5)  # the step is over: replica 1 takes them, 0 starts and loads them
        deadline = time.monotonic() + 180
        while (status := engine.replica_status()[0])["state"] != "ready":
            assert time.monotonic() < deadline, status
            time.sleep(0.5)
        assert status["version"] == 5 and status["restarts"] == 1 and not status["asleep"]
    finally:
        engine.close()
