"""The CUDA path: bf16 engines, the learner on GPU, NCCL under torchrun, the official vLLM wheel.

Every test here is marked ``gpu`` and is skipped (not failed) without CUDA; the vLLM ones also
need vLLM importable, the NCCL one two GPUs. Run on a GPU box with ``pytest -m gpu``.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from agentjet_server.engine.base import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


async def _sample(engine, prompt, params):
    return [event async for event in engine.generate(prompt, params)]


def _reference_logprobs(model_dir, weights, ids, completion, dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to("cuda")
    if weights is not None:
        model.load_state_dict(weights)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids + completion], device="cuda")).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    return [float(logp[len(ids) - 1 + j, t]) for j, t in enumerate(completion)]


def test_transformers_engine_bf16_on_cuda_samples_and_updates(chatty_model_dir):
    from agentjet_server.engine.base import EngineOptions
    from agentjet_server.engine.hf import TransformersEngine

    engine = TransformersEngine(chatty_model_dir, EngineOptions(device="cuda", dtype=torch.bfloat16))
    try:
        ids = engine.render([{"role": "user", "content": "Say something."}])
        events = asyncio.run(_sample(engine, ids, SamplingParams(max_tokens=16, seed=1)))
        assert len(events) > 0 and all(e.version == 0 for e in events)
        new = {k: v.float().cpu() + 0.01 for k, v in engine.model.state_dict().items()}
        engine.update_weights(new, 1)
        events = asyncio.run(_sample(engine, ids, SamplingParams(max_tokens=16, seed=1)))
        assert {e.version for e in events} == {1}
        got = [e.logprob for e in events]
        want = _reference_logprobs(chatty_model_dir, new, ids, [e.token_id for e in events], torch.bfloat16)
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 5e-2  # bf16
    finally:
        engine.close()


def _batch():
    """One group of four one-turn episodes on random tokens, rewards 0 and 1."""
    import random

    from agentjet_client.protocol import Trajectory, Turn
    from agentjet_server.learner.batch import build_batch

    rng = random.Random(0)
    group = [
        Trajectory(
            id=str(i),
            task_id="t",
            reward=float(i % 2),
            turns=[
                Turn(
                    policy_version=0,
                    prompt_token_ids=[rng.randrange(1000) for _ in range(20)],
                    completion_token_ids=[rng.randrange(1000) for _ in range(5)],
                    completion_logprobs=[-2.0] * 5,
                    finish_reason="stop",
                )
            ],
        )
        for i in range(4)
    ]
    return build_batch([group])


def test_learner_step_on_cuda_moves_the_weights(model_dir):
    from transformers import AutoModelForCausalLM

    from agentjet_server.learner.trainer import Learner, LearnerConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir).to("cuda")
    learner = Learner(model, LearnerConfig(lr=1e-3), pad_id=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    stats = learner.step(_batch())
    assert stats.grad_norm > 0
    assert any(not torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(v.device.type == "cpu" for v in learner.full_state_dict().values())


def test_fp32_learner_on_cuda_attends_without_the_quadratic_kernel(model_dir):
    """An fp32 step on one 2,048-token chain of a grouped-query model: transformers' grouped SDPA
    falls back to the math kernel, which keeps heads x length^2 floats per layer; the learner's
    attention repeats the key/value heads instead. Same loss, and a peak without that term."""
    import copy

    from transformers import AutoModelForCausalLM

    from agentjet_client.protocol import Trajectory, Turn
    from agentjet_server.learner import attention
    from agentjet_server.learner.batch import build_batch
    from agentjet_server.learner.trainer import Learner, LearnerConfig

    turns = [
        Turn(
            policy_version=0,
            prompt_token_ids=[10 + i % 200 for i in range(1024)],
            completion_token_ids=[20 + i % 150 for i in range(1024)],
            completion_logprobs=[-2.0] * 1024,
            finish_reason="length",
        )
    ]
    batch = build_batch([[Trajectory(id=str(i), task_id="t", reward=float(i), turns=turns) for i in range(2)]])
    results = {}
    for label in ("grouped", "repeated"):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to("cuda")
        assert model.config.num_key_value_heads < model.config.num_attention_heads
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        learner = Learner(model, LearnerConfig(tree_attention="segments"), pad_id=0)
        assert model.config._attn_implementation == attention.NAME
        if label == "grouped":
            model.set_attn_implementation("sdpa")  # transformers' own, as before the learner's
        stats = learner.step(copy.deepcopy(batch))
        torch.cuda.synchronize()
        results[label] = (stats.loss, torch.cuda.max_memory_allocated() - base)
        del learner, model
        torch.cuda.empty_cache()
    config = AutoModelForCausalLM.from_pretrained(model_dir).config
    quadratic = config.num_hidden_layers * config.num_attention_heads * 2048 * 2048 * 4
    print(f"peak grouped {results['grouped'][1] / 2**20:.0f} MiB, repeated {results['repeated'][1] / 2**20:.0f} MiB")
    assert results["repeated"][0] == pytest.approx(results["grouped"][0], abs=1e-5)
    assert results["grouped"][1] - results["repeated"][1] > 0.5 * quadratic


@pytest.mark.parametrize("learner_dtype", ["float32", "bfloat16"])
def test_learner_attention_on_cuda_groups_heads_only_where_flash_takes_them(model_dir, learner_dtype):
    """fp32: key/value heads repeated (no grouped call, which only the math kernel would take);
    bf16 autocast: transformers' grouped call as before (the query reaches the attention function
    in fp32 there, but the kernel gets bf16)."""
    from transformers import AutoModelForCausalLM

    from agentjet_server.learner.trainer import Learner, LearnerConfig

    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, value, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(
            (query.shape[1], key.shape[1], bool(kwargs.get("enable_gqa", False)), kwargs.get("attn_mask") is None)
        )
        return sdpa(query, key, value, **kwargs)

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to("cuda")
    learner = Learner(model, LearnerConfig(compute_dtype=learner_dtype, tree_attention="segments"), pad_id=0)
    torch.nn.functional.scaled_dot_product_attention = spy
    try:
        learner.step(_batch())
    finally:
        torch.nn.functional.scaled_dot_product_attention = sdpa
    unmasked = [call for call in calls if call[3]]  # chains without ancestors: no mask, grouped if allowed
    assert unmasked, calls[:3]
    if learner_dtype == "float32":
        assert all(q == k and not gqa for q, k, gqa, _ in calls), calls[:3]
    else:
        assert all(k < q and gqa for q, k, gqa, _ in unmasked), unmasked[:3]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for NCCL across processes")
def test_two_gpu_nccl_fsdp_step_equals_single_gpu(model_dir, tmp_path):
    from safetensors.torch import load_file

    from tests.server.learner.test_distributed import run_steps

    run_steps(model_dir, tmp_path / "one.safetensors", 1, "--device", "cuda")
    run_steps(model_dir, tmp_path / "two.safetensors", 2, "--device", "cuda")
    a, b = load_file(tmp_path / "one.safetensors"), load_file(tmp_path / "two.safetensors")
    worst = max(float((a[k] - b[k]).abs().max()) for k in a if not k.startswith("grad."))
    assert worst < 1e-4  # TF32/cuBLAS reductions differ from CPU's order; still one step's noise


def test_official_vllm_on_cuda_matches_transformers_after_an_update(chatty_model_dir):
    pytest.importorskip("vllm")
    from agentjet_server.engine.base import EngineOptions
    from agentjet_server.engine.vllm import VLLMEngine

    engine = VLLMEngine(chatty_model_dir, EngineOptions(device="cuda", dtype=torch.bfloat16))
    try:
        ids = engine.render([{"role": "user", "content": "Say something."}])
        from transformers import AutoModelForCausalLM

        new = {k: v + 0.01 for k, v in AutoModelForCausalLM.from_pretrained(chatty_model_dir).state_dict().items()}
        engine.update_weights(new, 1)
        events = asyncio.run(_sample(engine, ids, SamplingParams(max_tokens=16, seed=3)))
        assert {e.version for e in events} == {1}
        want = _reference_logprobs(chatty_model_dir, new, ids, [e.token_id for e in events], torch.bfloat16)
        assert max(abs(e.logprob - w) for e, w in zip(events, want, strict=True)) < 5e-2  # bf16
    finally:
        engine.close()


def test_cpu_offload_on_cuda_keeps_the_learners_state_in_host_memory(model_dir):
    """--cpu-offload: FSDP2 over a group of one; the shards and AdamW state in (pinned) host memory,
    the step computed on the GPU, and the same loss and gradient as the plain learner's."""
    import copy

    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from agentjet_server.learner.distributed import DistContext
    from agentjet_server.learner.trainer import Learner, LearnerConfig

    batch = _batch()
    try:
        dense = LearnerConfig(tree_attention="dense")
        plain = Learner(AutoModelForCausalLM.from_pretrained(model_dir).to("cuda"), dense, pad_id=0)
        want = plain.step(copy.deepcopy(batch))
        offload = Learner(
            AutoModelForCausalLM.from_pretrained(model_dir),
            LearnerConfig(cpu_offload=True, tree_attention="dense"),
            pad_id=0,
            ctx=DistContext(device="cuda"),
        )
        got = offload.step(copy.deepcopy(batch))
        assert all(p.to_local().device.type == "cpu" for p in offload.model.parameters())
        states = [t for s in offload.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]
        assert states and all(t.to_local().device.type == "cpu" for t in states)
        # the same loss and gradient (GPU reductions are not bit-reproducible; AdamW's first step
        # moves every weight by about lr whatever the gradient's size, so weights are no finer test)
        assert abs(got.loss - want.loss) < 1e-5 and got.grad_norm == pytest.approx(want.grad_norm, rel=1e-4)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_official_vllm_sleep_frees_its_gpu_memory_and_wakes_with_new_weights(chatty_model_dir):
    """--engine-sleep on a GPU: level 1 gives back the KV cache and the weights (to host memory);
    an update wakes it and the new weights are what it samples with."""
    pytest.importorskip("vllm")
    from agentjet_server.engine.base import EngineOptions
    from agentjet_server.engine.vllm import VLLMEngine

    engine = VLLMEngine(
        chatty_model_dir,
        EngineOptions(device="cuda", dtype=torch.bfloat16),
        sleep_mode=True,
        engine_args={"gpu_memory_utilization": 0.3},
    )
    try:
        ids = engine.render([{"role": "user", "content": "Say something."}])
        asyncio.run(_sample(engine, ids, SamplingParams(max_tokens=8, seed=3)))
        free_awake, total = torch.cuda.mem_get_info()
        engine.sleep()
        free_asleep, _ = torch.cuda.mem_get_info()
        # it reserved 0.3 of the device (KV cache, nearly all of it, with a tiny model)
        assert free_asleep - free_awake > 0.2 * total, (free_awake / 2**30, free_asleep / 2**30)
        from transformers import AutoModelForCausalLM

        new = {k: v + 0.01 for k, v in AutoModelForCausalLM.from_pretrained(chatty_model_dir).state_dict().items()}
        engine.update_weights(new, 1)  # wakes it first
        assert not engine.asleep
        events = asyncio.run(_sample(engine, ids, SamplingParams(max_tokens=16, seed=3)))
        assert {e.version for e in events} == {1}
        want = _reference_logprobs(chatty_model_dir, new, ids, [e.token_id for e in events], torch.bfloat16)
        assert max(abs(e.logprob - w) for e, w in zip(events, want, strict=True)) < 5e-2  # bf16
        freed = (free_asleep - free_awake) / 2**30
        asleep, awake = engine.sleeps[-1]
        print(f"vLLM sleep freed {freed:.2f} GiB; asleep in {asleep:.2f}s, awake in {awake:.2f}s")
    finally:
        engine.close()
