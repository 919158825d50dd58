"""Several LoRA adapters on one frozen base (the learner's side of an adapter per agent): a step of one
leaves the other bit-identical (weights and optimizer state) and the base unchanged, and each adapter
written in peft's format loads with peft and computes what the learner's model computes."""

import pytest
import torch

from agentjet_server.engine.adapter import LoraSpec, write_adapter
from agentjet_server.engine.lora_layers import activate, adapter_names, adapter_tensors
from agentjet_server.learner.batch import Batch, Sequence
from agentjet_server.learner.trainer import Learner, LearnerConfig

SPEC = LoraSpec(rank=4, alpha=8.0)
IDS = torch.tensor([[1, 5, 9, 40, 77, 3, 12, 30, 31, 2]])


def adapter_parameters(model, name):
    return [p for n, p in model.named_parameters() if f".lora_A.{name}." in n or f".lora_B.{name}." in n]


def _model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir)


def _learner(model_dir, seed=0, **config):
    torch.manual_seed(seed)
    model = _model(model_dir)
    settings = {"lr": 1e-2, "weight_decay": 0.01, "lora": SPEC, "adapters": ("planner", "executor"), **config}
    return model, Learner(model, LearnerConfig(**settings), pad_id=0)


def _batch(shift: int) -> Batch:
    sequences = [
        Sequence(
            list(range(5 + i + shift, 25 + i + shift)), list(range(10, 20)), [-2.0] * 10, [1.0 if i else -1.0] * 10
        )
        for i in range(2)
    ]
    return Batch(sequences, [0.0, 1.0], 1, 0, 2)


def test_a_step_of_one_adapter_leaves_the_other_bit_identical_and_the_base_unchanged(model_dir):
    model, learner = _learner(model_dir)
    assert adapter_names(model) == ["planner", "executor"]
    held = {id(p) for group in learner.optimizer.param_groups for p in group["params"]}
    assert held == {id(p) for name in ("planner", "executor") for p in adapter_parameters(model, name)}
    learner.step(_batch(0), "executor")  # both adapters have moved once (B is zero at the start)
    learner.step(_batch(1), "planner")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    executor = adapter_parameters(model, "executor")
    moments = {id(p): {n: t.clone() for n, t in learner.optimizer.state[p].items()} for p in executor}
    for shift in range(3):
        learner.step(_batch(shift), "planner")
    after = model.state_dict()
    assert any(not torch.equal(after[k], before[k]) for k in adapter_tensors(after, "planner")), "planner idle"
    assert all(torch.equal(after[k], before[k]) for k in adapter_tensors(after, "executor"))
    assert all(torch.equal(after[k], before[k]) for k in after if ".lora_" not in k)  # the base
    for p in executor:
        state = learner.optimizer.state[p]
        assert all(torch.equal(state[n], moments[id(p)][n]) for n in state)  # AdamW skipped it: same moments
    assert learner.adapter_weights("planner").keys() == adapter_tensors(after, "planner").keys()


def test_steps_and_weights_name_an_adapter_and_adapters_need_lora(model_dir):
    model, learner = _learner(model_dir)
    with pytest.raises(ValueError, match="names one of the learner's adapters"):
        learner.step(_batch(0))
    with pytest.raises(ValueError, match="not 'critic'"):
        learner.step(_batch(0), "critic")
    with pytest.raises(ValueError, match="no one merged model"):
        learner.full_state_dict()
    with pytest.raises(ValueError, match="no adapter 'critic'"):
        activate(model, "critic")
    with pytest.raises(ValueError, match="needs LoRA"):
        Learner(_model(model_dir), LearnerConfig(adapters=("a", "b")), pad_id=0)
    with pytest.raises(ValueError, match="distinct names"):
        _learner(model_dir, adapters=("a", "a"))


def test_each_adapter_loads_with_peft_and_computes_what_the_learner_computes(model_dir, tmp_path):
    from peft import PeftModel

    model, learner = _learner(model_dir)
    for shift, name in enumerate(("planner", "executor", "planner")):
        learner.step(_batch(shift), name)
    for name in ("planner", "executor"):
        write_adapter(tmp_path / name, learner.adapter_weights(name), SPEC, "base", name=name)
    outputs = {}
    with torch.no_grad():
        for name in ("planner", "executor"):
            activate(model, name)
            outputs[name] = model(input_ids=IDS).logits
            loaded = PeftModel.from_pretrained(_model(model_dir), str(tmp_path / name))
            assert float((loaded(input_ids=IDS).logits - outputs[name]).abs().max()) < 1e-5
    assert float((outputs["planner"] - outputs["executor"]).abs().max()) > 1e-4  # two different adapters


def test_a_checkpoint_holds_each_adapter_apart_and_resume_restores_both_and_their_moments(model_dir, tmp_path):
    from peft import PeftModel

    from agentjet_server.batching.buffer import BufferSnapshot
    from agentjet_server.state.checkpoint import CheckpointMeta, StateDir

    model, trained = _learner(model_dir)
    for shift, name in enumerate(("planner", "executor", "planner")):
        trained.step(_batch(shift), name)
    state_dir = StateDir.open(tmp_path / "state")
    try:
        meta = CheckpointMeta(
            step=3, version=3, next_lsn=0, buffer=BufferSnapshot(), trained=0, skipped_batches=0, segment=2
        )
        path = state_dir.write(meta, trained.training_state(), model, model_dir, keep=2)
        checkpoint = state_dir.latest()
        assert checkpoint is not None
        saved = checkpoint.trainer_state()
    finally:
        state_dir.close()
    assert sorted(p.name for p in (path / "adapters").iterdir()) == ["executor", "planner"]
    base = _model(model_dir).state_dict()
    assert saved["weights"].keys() == base.keys()  # model/ is the base, unmerged and unchanged
    assert all(torch.equal(saved["weights"][k], base[k]) for k in base)
    with torch.no_grad():  # each adapter dir loads with peft and computes what the learner computed
        activate(model, "executor")
        expected = model(input_ids=IDS).logits
        loaded = PeftModel.from_pretrained(_model(model_dir), str(path / "adapters" / "executor"))
        assert float((loaded(input_ids=IDS).logits - expected).abs().max()) < 1e-5
    _, restored = _learner(model_dir, seed=99)  # its adapters start elsewhere: loading must overwrite them
    assert not torch.equal(*(next(iter(x.adapter_weights("planner").values())) for x in (trained, restored)))
    restored.load_training_state(saved)
    assert restored.steps == 3
    for name in ("planner", "executor"):
        a, b = trained.adapter_weights(name), restored.adapter_weights(name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for (name, p), q in zip(trained.model.named_parameters(), restored.model.parameters(), strict=True):
        if p.requires_grad or ".lora_" in name:
            sa, sb = trained.optimizer.state.get(p, {}), restored.optimizer.state.get(q, {})
            assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa), name
    trained.step(_batch(5), "executor")  # one more step from each: the same weights to the bit
    restored.step(_batch(5), "executor")
    a, b = trained.adapter_weights("executor"), restored.adapter_weights("executor")
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="resume it with --adapters planner,executor"):
        _learner(model_dir, adapters=("planner", "critic"))[1].load_training_state(saved)
    with pytest.raises(ValueError, match="resume it without --adapters"):
        _learner(model_dir)[1].load_training_state({**saved, "adapters": None, "adapter": saved["adapters"]["planner"]})
