"""The memory plan: estimates against a measured peak, refusals that name flags that fit, and the
learner's precision and checkpointing options against fp32 numerics."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from agentjet_server.errors import ConfigError
from agentjet_server.learner.batch import Batch, Sequence
from agentjet_server.learner.trainer import Learner, LearnerConfig
from agentjet_server.memory import (
    GIB,
    Layout,
    check,
    local_learner_devices,
    plan,
    remedies,
    same_device,
    sleeping_replicas,
)
from agentjet_server.model_shape import ModelShape
from agentjet_server.settings import ServerSettings

ROOT = Path(__file__).resolve().parents[2]
SEVEN_B = {  # Qwen2.5-7B's published shape
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": False,
}


@pytest.fixture(scope="module")
def seven_b(tmp_path_factory) -> Path:
    """A config-only model dir: the plan reads shapes, never weights (there are none)."""
    target = tmp_path_factory.mktemp("qwen2-7b")
    (target / "config.json").write_text(json.dumps(SEVEN_B))
    return target


def test_the_shape_comes_from_the_config_alone(seven_b):
    shape = ModelShape.from_pretrained(seven_b)
    assert 7.5e9 < shape.parameters < 7.7e9  # 7.62B, as published
    assert (shape.layers, shape.kv_heads, shape.head_dim) == (28, 4, 128)


def test_a_7b_model_on_one_gpu_is_refused_in_fp32_and_the_named_flags_make_it_fit(seven_b):
    shape = ModelShape.from_pretrained(seven_b)
    gpu = {"cuda:0": 141 * GIB, "cpu": 64 * GIB}
    layout = Layout(engine="vllm", engine_device="cuda:0", learner_device="cuda:0", engine_dtype="bfloat16")
    fp32 = plan(shape, layout, gpu)
    assert not fp32.fits
    learner = {i.name: i.bytes for i in fp32.devices[0].items}
    assert learner["AdamW state"] == 2 * shape.parameters * 4 and learner["learner weights"] == shape.parameters * 4
    flags = remedies(shape, layout, gpu)
    assert flags == [
        "--gradient-checkpointing",
        "--learner-dtype bfloat16 --optimizer-dtype bfloat16",
    ]  # fp32 master weights + AdamW: 122 GB
    fixed = {
        "--gradient-checkpointing": {"gradient_checkpointing": True},
        "--learner-dtype bfloat16": {"learner_dtype": "bfloat16"},
        "--micro-batch-tokens 2048": {"micro_batch_tokens": 2048},
        "--dtype bfloat16": {"engine_dtype": "bfloat16"},
        "--learner-dtype bfloat16 --optimizer-dtype bfloat16": {
            "optimizer_dtype": "bfloat16",
            "learner_dtype": "bfloat16",
        },
    }
    changes: dict = {}
    for flag in flags:
        changes.update(fixed[flag])
    assert plan(shape, replace(layout, **changes), gpu).fits
    # on an 80 GB card: offloading the learner's fp32 state to host memory (122 GB of it) where the
    # host has the memory, else all-bf16 with the engine asleep during steps; and nothing fits 16 GB
    assert remedies(shape, layout, {"cuda:0": 80 * GIB, "cpu": 512 * GIB}) == [
        "--gradient-checkpointing",
        "--cpu-offload",
    ]
    assert remedies(shape, layout, {"cuda:0": 80 * GIB, "cpu": 64 * GIB}) == [
        "--gradient-checkpointing",
        "--learner-dtype bfloat16 --optimizer-dtype bfloat16",
        "--engine-sleep",
    ]
    assert remedies(shape, layout, {"cuda:0": 16 * GIB, "cpu": 64 * GIB}) is None
    # separate devices halve what each holds
    split = replace(layout, engine_device="cuda:1", **changes)
    both = plan(shape, split, {"cuda:0": 141 * GIB, "cuda:1": 141 * GIB})
    assert [d.device for d in both.devices] == ["cuda:1", "cuda:0"] and both.fits


# vLLM and the learner on one GPU, everything in bf16, checkpointed layers: the cheapest layout
# without the two flags that cost speed (--engine-sleep, --cpu-offload)
COLOCATED_BF16 = Layout(
    engine="vllm",
    engine_device="cuda:0",
    learner_device="cuda:0",
    engine_dtype="bfloat16",
    learner_dtype="bfloat16",
    optimizer_dtype="bfloat16",
    gradient_checkpointing=True,
)


def _by_name(device) -> dict[str, int]:
    return {i.name: i.bytes for i in device.items}


def test_cpu_offload_moves_the_learners_state_to_host_memory(seven_b):
    shape = ModelShape.from_pretrained(seven_b)
    layout = COLOCATED_BF16
    machine = {"cuda:0": 48 * GIB, "cpu": 512 * GIB}
    assert not plan(shape, layout, machine).fits and remedies(shape, layout, machine) == ["--cpu-offload"]
    offloaded = plan(shape, replace(layout, cpu_offload=True), machine)
    assert offloaded.fits and [d.device for d in offloaded.devices] == ["cuda:0", "cpu"]
    gpu, host = _by_name(offloaded.devices[0]), _by_name(offloaded.devices[1])
    p = shape.parameters
    assert host["learner weights"] == 2 * p and host["gradients"] == 2 * p and host["AdamW state"] == 4 * p
    assert not {"learner weights", "gradients", "AdamW state"} & set(gpu)
    # on the device: the root (embeddings and head, 1.1B of 7.6B) and two of the 28 layers at a time
    assert 0.15 * 2 * p < gpu["gathered weights"] < 0.25 * 2 * p
    # vLLM gets what the learner no longer holds on the device
    assert offloaded.layout.gpu_memory_utilization > plan(shape, layout, machine).layout.gpu_memory_utilization + 0.3
    # the host must hold it all: every learner rank of the machine has its shard there
    assert not plan(shape, replace(layout, cpu_offload=True), {"cuda:0": 48 * GIB, "cpu": 32 * GIB}).fits
    eight = plan(shape, replace(layout, cpu_offload=True, learner_ranks=8, local_ranks=8), machine)
    assert _by_name(eight.devices[1])["AdamW state"] == host["AdamW state"]
    assert _by_name(eight.devices[0])["gathered weights"] == gpu["gathered weights"]  # gathered whole on each rank
    # a learner on the CPU has nothing to offload to: the flag is never suggested there
    assert "--cpu-offload" not in (remedies(shape, Layout(), {"cpu": 64 * GIB}) or [])


def test_engine_sleep_plans_the_larger_of_serving_and_stepping_not_their_sum(seven_b):
    shape = ModelShape.from_pretrained(seven_b)
    layout = COLOCATED_BF16
    machine = {"cuda:0": 80 * GIB, "cpu": 512 * GIB}
    awake = plan(shape, layout, machine)
    assert not awake.fits and remedies(shape, layout, machine) == ["--engine-sleep"]
    asleep = plan(shape, replace(layout, engine_sleep=True), machine)
    assert asleep.fits
    device = asleep.devices[0]
    always = sum(i.bytes for i in device.items if not i.phase)
    serving = sum(i.bytes for i in device.items if i.phase == "serving")
    step = sum(i.bytes for i in device.items if i.phase == "step")
    assert {i.name for i in device.items if i.phase == "serving"} == {"engine weights", "engine KV cache"}
    assert {"gradients", "activations", "engine while asleep"} <= {i.name for i in device.items if i.phase == "step"}
    assert device.total == always + max(serving, step) < always + serving + step
    # the KV cache gets what the learner needs only while it steps
    assert asleep.layout.gpu_memory_utilization > awake.layout.gpu_memory_utilization + 0.2
    assert "freed while the learner steps" in asleep.describe() and "only during a step" in asleep.describe()
    # on a device of its own the engine is never in the learner's way: the flag changes nothing there
    split = replace(layout, engine_device="cuda:1")
    assert remedies(shape, split, {"cuda:0": 20 * GIB, "cuda:1": 80 * GIB, "cpu": 512 * GIB}) == ["--cpu-offload"]
    # nor with the transformers engine (it has no sleep mode)
    hf = replace(layout, engine="transformers")
    assert "--engine-sleep" not in (remedies(shape, hf, machine) or [])


def test_sharding_divides_weights_gradients_and_optimizer_state_by_the_ranks(seven_b):
    shape = ModelShape.from_pretrained(seven_b)
    one = {
        i.name: i.bytes
        for i in plan(shape, Layout(learner_device="cuda:0"), {"cpu": GIB, "cuda:0": GIB}).devices[1].items
    }
    eight = {
        i.name: i.bytes
        for i in plan(shape, Layout(learner_device="cuda:0", learner_ranks=8), {"cpu": GIB, "cuda:0": GIB})
        .devices[1]
        .items
    }
    for name in ("learner weights", "gradients", "AdamW state"):
        assert eight[name] == one[name] // 8
    assert eight["activations"] == one["activations"]


def _up_with_budget(model: Path, budget_gb: int, state: Path) -> tuple[int, str]:
    flags = ["--model", str(model), "--port", "0", "--memory-budget-gb", str(budget_gb), "--state-dir", str(state)]
    out = subprocess.run(
        [sys.executable, "-m", "agentjet_server", "up", *flags],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    return out.returncode, " ".join((out.stdout + out.stderr).split())


def test_up_refuses_a_layout_that_cannot_fit_before_loading_anything(seven_b, tmp_path):
    code, text = _up_with_budget(seven_b, 200, tmp_path / "state")  # the dir has no weights to load
    assert code == 2, text
    assert "need more memory than there is" in text and "does NOT fit" in text
    assert "it would fit with --gradient-checkpointing" in text and "--no-memory-check" in text
    code, text = _up_with_budget(seven_b, 16, tmp_path / "state")
    assert code == 2 and "separate devices" in text and "smaller model" in text


def test_settings_refuse_contradictory_memory_flags(tmp_path):
    with pytest.raises(ValueError, match="add --learner-dtype bfloat16"):
        ServerSettings(optimizer_dtype="bfloat16")
    with pytest.raises(ValueError, match="needs --engine vllm"):
        ServerSettings(gpu_memory_utilization=0.5)
    with pytest.raises(ValueError, match="one device"):
        ServerSettings(engine_devices="cuda:0,cuda:1")
    with pytest.raises(ValueError, match="add --engine vllm"):
        ServerSettings(engine_sleep=True)


def test_under_torchrun_rank_0_plans_the_engine_on_its_device_and_the_other_ranks_only_their_shard(seven_b):
    settings = ServerSettings(model=seven_b, device="cuda", engine="vllm", memory_budget_gb=141)
    settings = settings.model_copy(update={"learner_dtype": "bfloat16", "optimizer_dtype": "bfloat16"})
    main = check(settings, seven_b, "cuda:0", 8, serves=True)
    other = check(settings, seven_b, "cuda:3", 8, serves=False)
    assert [d.device for d in main.devices] == ["cuda:0"] and [d.device for d in other.devices] == ["cuda:3"]
    assert "engine weights" in {i.name for i in main.devices[0].items}
    assert not {"engine weights", "engine KV cache"} & {i.name for i in other.devices[0].items}
    split = check(settings.model_copy(update={"engine_devices": "cuda:7"}), seven_b, "cuda:0", 8, serves=True)
    assert [d.device for d in split.devices] == ["cuda:7", "cuda:0"]


def test_replicas_on_the_ranks_devices_are_planned_by_their_rank_and_those_there_sleep(seven_b, monkeypatch):
    """8 ranks, 8 vLLM replicas, each pair on one GPU: every rank's plan holds its replica (asleep
    during steps); replicas on devices of their own serve on."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    gpus = ",".join(f"cuda:{i}" for i in range(8))
    settings = ServerSettings(
        model=seven_b,
        device="cuda",
        engine="vllm",
        engine_replicas=8,
        engine_devices=gpus,
        engine_sleep=True,
        learner_dtype="bfloat16",
        gradient_checkpointing=True,
        memory_budget_gb=40,
    )
    learners = local_learner_devices(settings, "cuda:0", 8)
    assert learners == [f"cuda:{i}" for i in range(8)]
    assert sleeping_replicas(settings, learners) == list(range(8))
    main = check(settings, seven_b, "cuda:0", 8, serves=True)
    other = check(settings, seven_b, "cuda:5", 8, serves=False)
    for result, device in ((main, "cuda:0"), (other, "cuda:5")):
        assert [d.device for d in result.devices] == [device] and result.fits
        items = {i.name: i for i in result.devices[0].items}
        assert items["engine weights"].phase == "serving" and items["engine while asleep"].phase == "step"
    assert other.layout.gpu_memory_utilization == main.layout.gpu_memory_utilization
    # replicas run on rank 0's machine: the ranks of the second node plan none
    monkeypatch.setenv("GROUP_RANK", "1")
    second = check(settings, seven_b, "cuda:5", 16, serves=False)
    assert "engine weights" not in {i.name for i in second.devices[0].items}
    monkeypatch.setenv("GROUP_RANK", "0")
    # awake through the steps, the same pairs do not fit 40 GB (what the sleep buys)
    with pytest.raises(ConfigError, match="need more memory than there is"):
        check(settings.model_copy(update={"engine_sleep": False}), seven_b, "cuda:5", 8, serves=False)
    # 4 ranks on cuda:0-3, replicas on cuda:2-5: cuda:2 and cuda:3 are shared, so those two sleep
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    mixed = settings.model_copy(
        update={"engine_replicas": 4, "engine_devices": "cuda:2,cuda:3,cuda:4,cuda:5", "memory_budget_gb": 141}
    )
    assert sleeping_replicas(mixed, local_learner_devices(mixed, "cuda:0", 4)) == [0, 1]
    assert "engine weights" not in {i.name for i in check(mixed, seven_b, "cuda:1", 4, serves=False).devices[0].items}
    shared = check(mixed, seven_b, "cuda:3", 4, serves=False).devices[0].items
    assert {i.name: i.phase for i in shared}["engine weights"] == "serving"
    # on CPU every replica shares the learner's memory; "cuda" alone is cuda:0
    assert same_device("cuda", "cuda:0") and same_device("cpu", "cpu") and not same_device("cuda:1", "cuda:0")
    cpu = ServerSettings(engine="vllm", engine_replicas=2, engine_sleep=True)
    assert sleeping_replicas(cpu, local_learner_devices(cpu, "cpu", 1)) == [0, 1]
    single = settings.model_copy(update={"engine_devices": "cuda:1,cuda:2", "engine_replicas": 2})
    assert sleeping_replicas(single, local_learner_devices(single, "cuda", 1)) == []


def test_engine_sleep_with_no_replica_on_a_learners_device_is_refused(tmp_path):
    flags = ["--engine", "vllm", "--engine-replicas", "2", "--engine-devices", "cuda:0,cuda:1", "--engine-sleep"]
    flags += ["--port", "0", "--state-dir", str(tmp_path / "state")]
    out = subprocess.run(
        [sys.executable, "-m", "agentjet_server", "up", *flags], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    text = " ".join((out.stdout + out.stderr).split())
    assert out.returncode == 2, text
    assert "learner's devices (cpu)" in text and "leave --engine-sleep out" in text


def test_check_fits_the_embedded_model_and_can_be_overridden(model_dir):
    settings = ServerSettings(memory_budget_gb=4)
    assert check(settings, model_dir, "cpu", 1).fits
    tight = ServerSettings(memory_budget_gb=0.3)
    with pytest.raises(ConfigError, match="--no-memory-check"):
        check(tight, model_dir, "cpu", 1)
    assert not check(tight.model_copy(update={"memory_check": False}), model_dir, "cpu", 1).fits


# bf16 matmuls are fast on CPUs with AVX-512 or AMX (oneDNN's bf16 path); on an AVX2-only CPU they
# fall back to slow kernels (one bf16 step of the 26M model there: about 300 s, against 26 s in
# fp32), so such a host measures the checkpointing branch of the estimate in fp32 instead
_BF16_FAST = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
_SECOND = (
    {"learner_dtype": "bfloat16", "gradient_checkpointing": True} if _BF16_FAST else {"gradient_checkpointing": True}
)


@pytest.mark.parametrize(
    "layout", [{}, _SECOND], ids=["fp32", "bf16 + checkpointing" if _BF16_FAST else "checkpointing"]
)
def test_estimate_is_within_20_percent_of_the_measured_peak(tmp_path, layout):
    """bench/memory.py's measurement on the 26M model, in a fresh process per layout."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import memory as bench
    finally:
        sys.path.remove(str(ROOT / "bench"))
    model = bench.build("26M", tmp_path / "m")
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "memory.py"), "--child", str(model), json.dumps(layout), "2048"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    measured = json.loads(out.stdout.strip().splitlines()[-1])["peak"]
    estimated = bench.estimate(model, layout, 2048)
    assert 0.8 <= estimated / measured <= 1.2, (estimated / 2**20, measured / 2**20)


# -- numerics --------------------------------------------------------------------------------------


def _batch(vocab: int) -> Batch:
    """Two groups sharing a prompt each (a dense prefix tree), advantages of both signs."""
    g = torch.Generator().manual_seed(3)
    sequences = []
    for group in range(2):
        prompt = torch.randint(5, vocab - 5, (60,), generator=g).tolist()
        for i in range(4):
            completion = torch.randint(5, vocab - 5, (24,), generator=g).tolist()
            trained = list(range(60, 84))
            old = (-torch.rand(24, generator=g) * 3 - 4).tolist()  # about what a fresh model samples at
            sequences.append(Sequence(prompt + completion, trained, old, [1.0 - 0.6 * i] * 24, group=group))
    return Batch(sequences, [0.0] * 8, 2, 0, 8)


def _step(model_dir: Path, config: LearnerConfig, dtype: torch.dtype = torch.float32) -> tuple[Learner, float]:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    learner = Learner(model, config, pad_id=0)
    stats = learner.step(_batch(int(model.config.vocab_size)))
    return learner, stats.loss


def _grads(learner: Learner) -> torch.Tensor:
    return torch.cat([p.grad.float().flatten() for p in learner.model.parameters() if p.grad is not None])


def test_gradient_checkpointing_gives_the_same_step(model_dir):
    plain, plain_loss = _step(model_dir, LearnerConfig(lr=1e-3, tree_attention="dense"))
    ckpt, ckpt_loss = _step(model_dir, LearnerConfig(lr=1e-3, gradient_checkpointing=True))
    assert abs(plain_loss - ckpt_loss) < 1e-6
    assert torch.allclose(_grads(plain), _grads(ckpt), atol=1e-7, rtol=1e-5)
    for a, b in zip(plain.model.parameters(), ckpt.model.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def test_bf16_learner_agrees_with_fp32_within_bf16_precision(model_dir):
    fp32, fp32_loss = _step(model_dir, LearnerConfig(lr=1e-3))
    auto, auto_loss = _step(model_dir, LearnerConfig(lr=1e-3, compute_dtype="bfloat16"))
    pure, pure_loss = _step(model_dir, LearnerConfig(lr=1e-3, compute_dtype="bfloat16"), torch.bfloat16)
    reference = _grads(fp32)
    for learner, loss in ((auto, auto_loss), (pure, pure_loss)):
        assert abs(loss - fp32_loss) <= 0.03 * abs(fp32_loss) + 1e-3, (loss, fp32_loss)
        cosine = torch.nn.functional.cosine_similarity(_grads(learner), reference, dim=0)
        assert cosine > 0.98, cosine
    # autocast keeps fp32 master weights and AdamW state; all-bf16 keeps both in bf16
    assert {p.dtype for p in auto.model.parameters()} == {torch.float32}
    assert {s["exp_avg"].dtype for s in auto.optimizer.state.values()} == {torch.float32}
    assert {p.dtype for p in pure.model.parameters()} == {torch.bfloat16}
    assert {s["exp_avg"].dtype for s in pure.optimizer.state.values()} == {torch.bfloat16}
    # the fp32-master step moves the weights as fp32 does, to within bf16's resolution of the gradient
    moved = [(a - b).abs().max() for a, b in zip(auto.model.parameters(), fp32.model.parameters(), strict=True)]
    assert max(moved) < 2e-3  # lr 1e-3: a sign flip of one update would show as 2e-3


def test_cpu_offload_steps_like_the_plain_learner_and_its_checkpoints_load_either_way(model_dir):
    """--cpu-offload alone: FSDP2 over a process group of one, its state in host memory (on CPU the
    same memory, so what is checked here is the numerics and the checkpoint, not the placement)."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    plain_config = LearnerConfig(lr=1e-3, tree_attention="dense")
    offload_config = LearnerConfig(lr=1e-3, cpu_offload=True)
    try:
        plain, plain_loss = _step(model_dir, plain_config)
        offload, offload_loss = _step(model_dir, offload_config)
        assert offload.sharded and not plain.sharded and dist.get_world_size() == 1
        assert all(hasattr(p, "full_tensor") for p in offload.model.parameters())  # FSDP's sharded tensors
        assert abs(plain_loss - offload_loss) < 1e-6
        batch = _batch(int(plain.model.config.vocab_size))

        def apart(a: Learner, b: Learner) -> float:
            x, y = a.full_state_dict(), b.full_state_dict()
            assert x.keys() == y.keys()
            return max(float((x[k] - y[k]).abs().max()) for k in x)

        plain.step(batch)
        offload.step(batch)
        assert apart(plain, offload) < 1e-6
        before = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
        moved = offload.full_state_dict()
        assert max(float((moved[k] - before[k]).abs().max()) for k in before if k in moved) > 1e-4
        # an offloaded learner's checkpoint resumes a plain one, and the other way round, exactly (a
        # copy, as from disk: the state's tensors are the live optimizer's, which the source goes on with)
        for source, config in ((offload, plain_config), (plain, offload_config)):
            resumed = Learner(AutoModelForCausalLM.from_pretrained(model_dir), config, pad_id=0)
            resumed.load_training_state(copy.deepcopy(source.training_state()))
            assert resumed.steps == 2 and apart(resumed, source) == 0.0
            resumed.step(batch)
            source.step(batch)
            assert apart(resumed, source) < 1e-6
        offload.release_gradients()
        assert all(p.grad is None for p in offload.model.parameters())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.e2e
def test_up_with_cpu_offload_trains_checkpoints_and_resumes(model_dir, tmp_path):
    """``agentjet-server up --cpu-offload`` in one process: FSDP2 over a group of one, trained by a
    client run, a checkpoint on stop that a resumed server (offloaded again) continues from."""
    from tests.conftest import ServerProcess, run_digits_client

    state = tmp_path / "state"
    # an entropy bonus gives a batch whose groups all tie a gradient too, so every batch steps: without
    # it a policy that settled on one answer ties every group of a word it gets always right or always
    # wrong, and a CI run once skipped all six batches of a resumed run (nothing left to check there)
    args = ["--cpu-offload", "--batch-groups", "2", "--group-size", "8", "--entropy-coef", "0.001"]
    args += ["--state-dir", str(state)]
    server = ServerProcess(args, tmp_path / "server.log")
    try:
        run_digits_client(server.url, 32, 8)
        status = server.wait_trained()
        trained = status["policy_version"]
        assert trained == 2 and status["learner"]["skipped_batches"] == 0, status["learner"]
        assert status["learner"]["last_error"] is None
    finally:
        server.stop()
    log = (tmp_path / "server.log").read_text()
    assert "Traceback" not in log and "terminate called" not in log
    resumed = ServerProcess([*args, "--resume"], tmp_path / "resumed.log")
    try:
        before = resumed.status()
        assert before["policy_version"] == trained
        run_digits_client(resumed.url, 32, 8, digits="1,6")
        status = resumed.wait_trained()
        assert status["policy_version"] - trained == 2, status["learner"]  # every batch of the resumed run
        assert status["learner"]["skipped_batches"] == 0 and status["learner"]["last_error"] is None
    finally:
        resumed.stop()


def test_an_adapter_per_agent_is_one_base_and_each_adapters_weights_and_moments(seven_b):
    """Two adapters on one 7B base against two servers of one adapter each: the base, the engine's
    weights and its caches once instead of twice; per adapter its weights and AdamW moments; no merged
    copy (the engine takes each adapter alone)."""
    from agentjet_server.memory import adapter_parameters, layout_for

    shape = ModelShape.from_pretrained(seven_b)
    gpu = {"cuda:0": 141 * GIB, "cpu": 64 * GIB}
    base = Layout(engine_device="cuda:0", learner_device="cuda:0", engine_dtype="bfloat16", lora_rank=16)
    one, team = plan(shape, base, gpu), plan(shape, replace(base, adapters=2), gpu)
    items = {i.name: i.bytes for i in team.devices[0].items}
    a = adapter_parameters(shape, 16)
    assert items["LoRA adapters"] == 2 * a * 4 and items["AdamW state"] == 2 * 2 * a * 4
    assert items["gradients"] == a * 4 and items["engine adapters"] == 2 * a * 2
    assert "merged weights for the engine" not in " ".join(items) and "learner weights" in items
    two_servers = 2 * one.devices[0].total
    assert team.devices[0].total < 0.6 * two_servers, (team.devices[0].total / GIB, two_servers / GIB)
    settings = ServerSettings(lora_rank=16, adapters="planner,executor")
    assert layout_for(settings, "cuda:0", 1).adapters == 2


def test_a_distillation_teacher_is_planned_at_its_own_size_in_the_learners_precision(seven_b, model_dir):
    """``--teacher DIR``: the teacher's parameters (read from its config, not the student's) once, frozen, in
    the learner's compute precision, on the learner's device."""
    from agentjet_server.memory import layout_for

    shape = ModelShape.from_pretrained(model_dir)
    teacher = ModelShape.from_pretrained(seven_b).parameters
    base = Layout(engine_device="cpu", learner_device="cpu", learner_dtype="bfloat16", optimizer_dtype="bfloat16")
    without, with_teacher = (
        plan(shape, base, {"cpu": 512 * GIB}),
        plan(shape, replace(base, teacher_parameters=teacher), {"cpu": 512 * GIB}),
    )
    items = {i.name: i.bytes for i in with_teacher.devices[0].items}
    assert items["teacher model"] == teacher * 2
    assert with_teacher.devices[0].total - without.devices[0].total == teacher * 2
    assert layout_for(ServerSettings(teacher=seven_b), "cpu", 1).teacher_parameters == teacher
    assert layout_for(ServerSettings(), "cpu", 1).teacher_parameters == 0
