"""Several LoRA adapters on one frozen base (the learner's side of an adapter per agent): a step of one
leaves the other bit-identical and the base unchanged, each optimizer holds only its adapter, and each
adapter written in peft's format loads with peft and computes what the learner's model computes."""

import pytest
import torch

from agentjet_server.engine.adapter import LoraSpec, write_adapter
from agentjet_server.learner.adapters import (
    AdapterOptimizers,
    activate,
    adapter_names,
    adapter_parameters,
    adapter_tensors,
    attach_adapters,
)

SPEC = LoraSpec(rank=4, alpha=8.0)
IDS = torch.tensor([[1, 5, 9, 40, 77, 3, 12, 30, 31, 2]])


def _model(model_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(model_dir)


def _train_step(model, optimizers, name):
    """One step of adapter ``name`` on a next-token loss over ``IDS``."""
    activate(model, name)
    optimizers.zero_grad()
    logits = model(input_ids=IDS).logits[:, :-1]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), IDS[:, 1:].reshape(-1))
    loss.backward()
    optimizers.step(name)


def test_a_step_of_one_adapter_leaves_the_other_bit_identical_and_the_base_unchanged(model_dir):
    model = _model(model_dir)
    attach_adapters(model, SPEC, ["planner", "executor"])
    assert adapter_names(model) == ["planner", "executor"]
    optimizers = AdapterOptimizers(model, ["planner", "executor"], lr=1e-2, weight_decay=0.01)
    _train_step(model, optimizers, "executor")  # both adapters have moved once (B is zero at the start)
    _train_step(model, optimizers, "planner")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    executor_state = {
        k: {n: t.clone() for n, t in s.items()} for k, s in optimizers.optimizers["executor"].state.items()
    }
    for _ in range(3):
        _train_step(model, optimizers, "planner")
    after = model.state_dict()
    planner_moved = [k for k in adapter_tensors(after, "planner") if not torch.equal(after[k], before[k])]
    assert planner_moved, "the planner's adapter did not train"
    assert all(torch.equal(after[k], before[k]) for k in adapter_tensors(after, "executor"))
    assert all(torch.equal(after[k], before[k]) for k in after if ".lora_" not in k)  # the base
    for param, state in optimizers.optimizers["executor"].state.items():
        assert all(torch.equal(state[n], executor_state[param][n]) for n in state)
    assert optimizers.steps == {"planner": 4, "executor": 1}
    assert all(p.grad is None for p in adapter_parameters(model, "executor"))


def test_each_optimizer_holds_only_its_adapter_and_a_step_without_gradients_is_refused(model_dir):
    model = _model(model_dir)
    attach_adapters(model, SPEC, ["planner", "executor"])
    optimizers = AdapterOptimizers(model, ["planner", "executor"], lr=1e-3, weight_decay=0.0)
    for name, optimizer in optimizers.optimizers.items():
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        assert held == {id(p) for p in adapter_parameters(model, name)} and held
    activate(model, "planner")
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".planner." in n for n in trainable)
    with pytest.raises(ValueError, match="no gradient"):
        optimizers.step("executor")
    with pytest.raises(ValueError, match="no adapter 'critic'"):
        activate(model, "critic")
    with pytest.raises(ValueError, match="distinct names"):
        attach_adapters(_model(model_dir), SPEC, ["a", "a"])


def test_each_adapter_loads_with_peft_and_computes_what_the_learner_computes(model_dir, tmp_path):
    from peft import PeftModel

    model = _model(model_dir)
    attach_adapters(model, SPEC, ["planner", "executor"])
    optimizers = AdapterOptimizers(model, ["planner", "executor"], lr=1e-2, weight_decay=0.0)
    for name in ("planner", "executor", "planner"):
        _train_step(model, optimizers, name)
    state = model.state_dict()
    for name in ("planner", "executor"):
        write_adapter(tmp_path / name, adapter_tensors(state, name), SPEC, str(model_dir), name=name)
    outputs = {}
    with torch.no_grad():
        for name in ("planner", "executor"):
            activate(model, name)
            outputs[name] = model(input_ids=IDS).logits
            loaded = PeftModel.from_pretrained(_model(model_dir), str(tmp_path / name))
            assert float((loaded(input_ids=IDS).logits - outputs[name]).abs().max()) < 1e-5
    assert float((outputs["planner"] - outputs["executor"]).abs().max()) > 1e-4  # two different adapters
