"""The transformers engine: batching, version tags across a weight update, logprob exactness."""

import asyncio
import time

import pytest
import torch

from agentjet_server.engine.base import SamplingParams
from agentjet_server.engine.hf import TransformersEngine
from agentjet_server.errors import EngineError

PROMPT = [{"role": "user", "content": "Tell me something."}]


def _plain_logprobs(model, prompt, events):
    seq = prompt + [e.token_id for e in events]
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([seq])).logits[0], -1)
    return [float(logp[len(prompt) - 1 + i, e.token_id]) for i, e in enumerate(events)]


def collect(engine, ids, params):
    async def run():
        return [event async for event in engine.generate(ids, params)]

    return asyncio.run(run())


def test_concurrent_requests_share_forward_passes(chatty_model_dir):
    engine = TransformersEngine(chatty_model_dir)
    try:
        ids = engine.render(PROMPT)

        async def many():
            jobs = [engine.generate(ids, SamplingParams(max_tokens=16, seed=i)) for i in range(8)]
            return await asyncio.gather(*[_drain(job) for job in jobs])

        outs = asyncio.run(many())
        assert all(len(o) == 16 for o in outs)
        # 128 tokens: one forward pass each would be 128; batched, a pass serves several requests
        assert engine.largest_batch > 1 and engine.batches.forward_passes < 48
    finally:
        engine.close()


def test_a_group_of_identical_prompts_is_prefilled_once_and_new_weights_empty_the_prompt_cache(chatty_model_dir):
    from transformers import AutoModelForCausalLM

    engine = TransformersEngine(chatty_model_dir)
    try:
        prompts = [engine.render([{"role": "user", "content": f"Count to {n}."}]) for n in (3, 12)]

        async def group(version_seeds):
            jobs = [engine.generate(prompts[i % 2], SamplingParams(max_tokens=6, seed=s)) for i, s in version_seeds]
            return await asyncio.gather(*[_drain(job) for job in jobs])

        first = asyncio.run(group([(i, i) for i in range(16)]))
        # 16 requests, two distinct prompts: each prompt run once, however their arrivals were split
        assert engine.batches.prompts_run == 2 and engine.batches.prefills <= 2
        again = asyncio.run(group([(i, 100 + i) for i in range(4)]))  # the same weights: all four from the cache
        assert engine.batches.prompts_run == 2 and engine.batches.prompts.hits >= 4
        new = {k: v + 0.02 * torch.randn_like(v) for k, v in engine.state_dict().items()}
        engine.update_weights(new, 1)
        hits = engine.batches.prompts.hits
        after = asyncio.run(group([(0, 7)]))
        assert (
            engine.batches.prompts.hits == hits and engine.batches.prompts_run == 3
        )  # prefilled under the new weights
        model = AutoModelForCausalLM.from_pretrained(chatty_model_dir)
        for n, events in enumerate(first + again):
            expected = _plain_logprobs(model, prompts[n % 2] if n < 16 else prompts[(n - 16) % 2], events)
            assert max(abs(x - e.logprob) for x, e in zip(expected, events, strict=True)) < 1e-4
        model.load_state_dict(new)
        expected = _plain_logprobs(model, prompts[0], after[0])
        assert {e.version for e in after[0]} == {1}
        assert max(abs(x - e.logprob) for x, e in zip(expected, after[0], strict=True)) < 1e-4
    finally:
        engine.close()


async def _drain(gen):
    return [event async for event in gen]


def test_weights_swap_between_decode_steps_and_tokens_carry_their_version(chatty_model_dir):
    engine = TransformersEngine(chatty_model_dir)
    try:
        ids = engine.render(PROMPT)
        new = {k: v + 0.01 * torch.randn_like(v) for k, v in engine.state_dict().items()}
        events = []

        async def run():
            async for event in engine.generate(ids, SamplingParams(max_tokens=200, seed=0)):
                events.append(event)
                if len(events) == 5:
                    await asyncio.to_thread(engine.update_weights, new, 1)

        asyncio.run(run())
        versions = [e.version for e in events]
        assert versions == sorted(versions) and versions[0] == 0 and versions[-1] == 1
        assert engine.version == 1
        after = collect(engine, ids, SamplingParams(max_tokens=4, seed=0))
        assert {e.version for e in after} == {1}
    finally:
        engine.close()


def test_engine_logprobs_match_a_plain_forward_pass(chatty_model_dir):
    from transformers import AutoModelForCausalLM

    engine = TransformersEngine(chatty_model_dir)
    try:
        ids = engine.render(PROMPT)
        events = collect(engine, ids, SamplingParams(max_tokens=12, seed=3))
        expected = _plain_logprobs(AutoModelForCausalLM.from_pretrained(chatty_model_dir), ids, events)
        assert max(abs(a - b.logprob) for a, b in zip(expected, events, strict=True)) < 1e-4
    finally:
        engine.close()


def test_greedy_is_deterministic_and_closed_engine_refuses(chatty_model_dir):
    engine = TransformersEngine(chatty_model_dir)
    ids = engine.render(PROMPT)
    a = collect(engine, ids, SamplingParams(max_tokens=8, temperature=0.0))
    b = collect(engine, ids, SamplingParams(max_tokens=8, temperature=0.0))
    assert [e.token_id for e in a] == [e.token_id for e in b]
    engine.close()
    with pytest.raises(EngineError, match="shut down"):
        collect(engine, ids, SamplingParams(max_tokens=2))
    assert not engine._thread.is_alive()


def test_generation_stops_at_every_eos_id_the_generation_config_lists(chatty_model_dir, tmp_path):
    """A family whose generation config names several end tokens (Llama 3.1: three) stops at each."""
    import json
    import shutil

    engine = TransformersEngine(chatty_model_dir)
    ids = engine.render(PROMPT)
    rambling = [e.token_id for e in collect(engine, ids, SamplingParams(max_tokens=8, seed=5))]
    engine.close()
    end = next(t for t in rambling[2:] if t not in rambling[:2])  # a token it samples on the way
    model = tmp_path / "model"
    shutil.copytree(chatty_model_dir, model)
    config = (
        json.loads((model / "generation_config.json").read_text())
        if (model / "generation_config.json").exists()
        else {}
    )
    config["eos_token_id"] = [engine.chat.tokenizer.convert_tokens_to_ids("<|im_end|>"), end]
    (model / "generation_config.json").write_text(json.dumps(config))
    engine = TransformersEngine(model)
    events = collect(engine, ids, SamplingParams(max_tokens=8, seed=5))
    engine.close()
    stop = rambling.index(end)
    assert [e.token_id for e in events] == rambling[: stop + 1]
    assert events[-1].finish_reason == "stop"


def test_create_engine_honours_dtype(model_dir):
    import torch

    from agentjet_server.engine import create_engine, resolve_dtype

    assert resolve_dtype("auto", "cpu") == torch.float32 and resolve_dtype("auto", "cuda") == torch.bfloat16
    engine = create_engine("transformers", model_dir, model_name=None, device="cpu", max_batch=4, dtype="bfloat16")
    try:
        assert next(engine.model.parameters()).dtype == torch.bfloat16
    finally:
        engine.close()


def test_requests_join_and_leave_a_running_batch_and_stay_exact(chatty_model_dir):
    """Continuous batching: a newcomer gets its first token while an earlier request is still
    decoding, whether its prompt is longer than the running batch (the batch is padded) or shorter
    (the newcomer is padded); rows that finish leave, and every log-prob still equals a plain
    forward pass of that request alone."""
    from transformers import AutoModelForCausalLM

    engine = TransformersEngine(chatty_model_dir)
    try:
        short = engine.render(PROMPT)
        long = engine.render([{"role": "user", "content": "Tell me something about " + "the sea and " * 60}])
        assert len(long) > len(short) + 150
        events: dict[str, list] = {"a": [], "b": [], "c": []}
        seen_at_first: dict[str, int] = {}

        async def follow(name, ids, params, after=None):
            if after is not None:
                while len(events[after[0]]) < after[1]:
                    await asyncio.sleep(0.001)
            async for event in engine.generate(ids, params):
                if not events[name]:
                    seen_at_first[name] = len(events["a"])
                events[name].append(event)

        async def run():
            await asyncio.gather(
                follow("a", short, SamplingParams(max_tokens=240, seed=1)),
                follow("b", long, SamplingParams(max_tokens=30, seed=2), after=("a", 10)),
                follow("c", short, SamplingParams(max_tokens=20, seed=3), after=("b", 10)),
            )

        asyncio.run(run())
        assert [len(events[k]) for k in "abc"] == [240, 30, 20]
        # b and c joined a while a was decoding, not after it
        assert seen_at_first["b"] < 60 and seen_at_first["c"] < 120
        # c's prompt is a's, prefilled under the same weights: it joined from the prompt cache, no forward pass
        assert engine.largest_batch == 3 and engine.batches.prefills == 2 and engine.batches.prompts.hits == 1
        model = AutoModelForCausalLM.from_pretrained(chatty_model_dir)
        for name, prompt in (("a", short), ("b", long), ("c", short)):
            expected = _plain_logprobs(model, prompt, events[name])
            worst = max(abs(x - e.logprob) for x, e in zip(expected, events[name], strict=True))
            assert worst < 1e-4, (name, worst)
    finally:
        engine.close()


def test_a_request_joining_after_a_weight_update_samples_only_the_new_version(chatty_model_dir):
    from transformers import AutoModelForCausalLM

    engine = TransformersEngine(chatty_model_dir)
    try:
        ids = engine.render(PROMPT)
        new = {k: v + 0.02 * torch.randn_like(v) for k, v in engine.state_dict().items()}
        old_run: list = []
        new_run: list = []

        async def first():
            async for event in engine.generate(ids, SamplingParams(max_tokens=200, seed=0)):
                old_run.append(event)
                if len(old_run) == 5:
                    await asyncio.to_thread(engine.update_weights, new, 1)

        async def second():
            while engine.version != 1:
                await asyncio.sleep(0.001)
            async for event in engine.generate(ids, SamplingParams(max_tokens=20, seed=4)):
                new_run.append(event)

        async def run():
            await asyncio.gather(first(), second())

        asyncio.run(run())
        assert len(old_run) == 200
        versions = [e.version for e in old_run]
        assert versions == sorted(versions) and versions[0] == 0 and versions[-1] == 1
        assert {e.version for e in new_run} == {1}
        assert engine.largest_batch == 2
        model = AutoModelForCausalLM.from_pretrained(chatty_model_dir)
        model.load_state_dict(new)
        expected = _plain_logprobs(model, ids, new_run)
        assert max(abs(x - e.logprob) for x, e in zip(expected, new_run, strict=True)) < 1e-4
    finally:
        engine.close()


def test_a_cancelled_request_leaves_the_batch_and_the_others_go_on(chatty_model_dir):
    engine = TransformersEngine(chatty_model_dir)
    try:
        ids = engine.render(PROMPT)

        async def run():
            quitter = engine.generate(ids, SamplingParams(max_tokens=200, seed=1))
            stayer = asyncio.ensure_future(_drain(engine.generate(ids, SamplingParams(max_tokens=60, seed=2))))
            got = 0
            async for _ in quitter:
                got += 1
                if got == 3:
                    break
            await quitter.aclose()
            return await stayer

        kept = asyncio.run(run())
        assert len(kept) == 60 and kept[-1].finish_reason == "length"
        time.sleep(0.3)
        # the cancelled request stopped sampling within a step or two of its caller leaving
        assert engine.tokens_sampled <= 60 + 3 + 2
    finally:
        engine.close()
