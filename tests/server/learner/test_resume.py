"""A learner's training state (``learner.resume``), as a checkpoint keeps it and back: the weights under the
model's own names, the optimizer's state by parameter name, the step count and the RNG states; the critic
with PPO; with LoRA the adapter apart and the merged weights; a tied output head filled in on loading; and a
checkpoint refused where it cannot resume the learner it is given, saying what to pass instead."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from agentjet_server.engine.adapter import LoraSpec
from agentjet_server.learner.batch import build_batch
from agentjet_server.learner.resume import check_lora
from agentjet_server.learner.trainer import Learner, LearnerConfig
from agentjet_server.state.checkpoint import StateDir
from tests.server.state.runs import GROUP, make_trajectories


def learner(model_dir: Path, seed: int = 0, **config: object) -> Learner:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)  # fresh weights: a learner that resumes starts from other ones
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return Learner(model, LearnerConfig(lr=1e-2, **config), pad_id=0)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def groups(model_dir: Path) -> list:  # type: ignore[type-arg]
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    trajectories = make_trajectories(vocab, 1)
    return [trajectories[i : i + GROUP] for i in range(0, 2 * GROUP, GROUP)]


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_training_state_holds_weights_by_name_optimizer_by_parameter_name_steps_and_rng(model_dir, groups):
    trained = learner(model_dir)
    trained.step(build_batch(groups))
    state = trained.training_state()
    assert set(state) == {"weights", "optimizer", "steps", "rng", "python_rng"} and state["steps"] == 1
    assert same(state["weights"], trained.model.state_dict())  # the model's own names: a plain HF checkpoint
    names = {name for name, _ in trained.policy.named_parameters()}
    moments = state["optimizer"]["state"]
    assert set(moments) == names and all(set(m) == {"step", "exp_avg", "exp_avg_sq"} for m in moments.values())
    later = torch.rand(4), random.random()  # what the run draws after its checkpoint

    restored = learner(model_dir, seed=1)
    assert not same(restored.model.state_dict(), trained.model.state_dict())
    restored.load_training_state(state)
    assert restored.steps == 1 and same(restored.model.state_dict(), trained.model.state_dict())
    mine = restored.optimizer.state_dict()["state"]
    theirs = trained.optimizer.state_dict()["state"]
    assert all(same(mine[k], theirs[k]) for k in theirs)
    assert torch.equal(torch.rand(4), later[0]) and random.random() == later[1]  # it draws the same again


def test_a_ppo_state_carries_its_critic_and_a_grpo_one_cannot_resume_ppo(model_dir, groups):
    ppo = learner(model_dir, algorithm="ppo")
    ppo.step(build_batch(groups, algorithm="ppo"))
    state = ppo.training_state()
    assert ppo.policy.value_head is not None and same(state["critic"], ppo.policy.value_head.state_dict())
    assert float(state["critic"]["weight"].abs().max()) > 0  # it trained: the comparison below means something
    restored = learner(model_dir, seed=1, algorithm="ppo")
    restored.load_training_state(state)
    assert restored.policy.value_head is not None
    assert same(restored.policy.value_head.state_dict(), state["critic"])
    grpo = learner(model_dir).training_state()
    with pytest.raises(ValueError, match=r"no critic \(it was trained with --algorithm grpo\); resume it with"):
        learner(model_dir, seed=1, algorithm="ppo").load_training_state(grpo)


def test_a_lora_state_holds_the_adapter_apart_and_resumes_only_the_same_adapter(model_dir, groups):
    spec = LoraSpec(rank=4, alpha=8.0)
    adapted = learner(model_dir, lora=spec)
    adapted.step(build_batch(groups))
    state = adapted.training_state()
    assert state["lora"] == spec.as_dict()
    assert state["adapter"] and all(".lora_" in name for name in state["adapter"])
    plain = learner(model_dir).model.state_dict()
    assert state["weights"].keys() == plain.keys()  # merged: the base model's names, loadable without peft
    restored = learner(model_dir, seed=1, lora=spec)
    restored.load_training_state(state)
    assert restored.steps == 1 and same(restored.adapter_weights(), adapted.adapter_weights())
    with pytest.raises(ValueError, match="resume with the same --lora-\\* settings"):
        learner(model_dir, lora=LoraSpec(rank=2, alpha=8.0)).load_training_state(state)
    with pytest.raises(ValueError, match="trained a LoRA adapter \\(rank 4\\); resume it with the same --lora-rank 4"):
        learner(model_dir).load_training_state(state)
    full = learner(model_dir).training_state()
    with pytest.raises(ValueError, match="trained without LoRA"):
        learner(model_dir, lora=spec).load_training_state(full)


def test_mismatched_lora_settings_are_refused_with_the_flags_to_pass():
    spec = LoraSpec(rank=8, alpha=16.0)
    with pytest.raises(
        ValueError, match=r"resume it with the same --lora-rank 8 --lora-alpha 16\.0 --lora-targets all-linear"
    ):
        check_lora(spec.as_dict(), None)
    with pytest.raises(ValueError, match="trained without LoRA"):
        check_lora(None, spec)
    with pytest.raises(ValueError, match="same --lora-\\* settings"):
        check_lora(spec.as_dict(), LoraSpec(rank=4, alpha=16.0))
    check_lora(spec.as_dict(), LoraSpec(rank=8, alpha=16.0))  # the same settings resume
    check_lora(None, None)


def test_weights_missing_from_a_checkpoint_are_named(model_dir):
    state = learner(model_dir).training_state()
    del state["weights"]["model.norm.weight"]
    with pytest.raises(ValueError, match=r"the checkpoint has no weights for model\.norm\.weight"):
        learner(model_dir, seed=1).load_training_state(state)


def test_tied_head_model_round_trips_through_a_checkpoint(model_dir, groups, tmp_path):
    """HF drops a tied head from saved weights; loading fills it from the embedding, and the
    optimizer's moments come back for every parameter."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from agentjet_server.batching.buffer import BufferSnapshot
    from agentjet_server.learner.batch import build_batch
    from agentjet_server.learner.trainer import Learner, LearnerConfig
    from agentjet_server.state.checkpoint import CheckpointMeta

    config = AutoConfig.from_pretrained(model_dir)
    config.tie_word_embeddings = True

    def learner() -> Learner:
        torch.manual_seed(5)
        return Learner(AutoModelForCausalLM.from_config(config), LearnerConfig(lr=1e-2), pad_id=0)

    trained = learner()
    trained.step(build_batch(groups))
    state = StateDir.open(tmp_path / "state")
    try:
        meta = CheckpointMeta(
            step=1, version=1, next_lsn=0, buffer=BufferSnapshot(), trained=0, skipped_batches=0, segment=2
        )
        state.write(meta, trained.training_state(), trained.model, model_dir, keep=2)
        checkpoint = state.latest()
        assert checkpoint is not None
        restored = learner()
        restored.load_training_state(checkpoint.trainer_state())
    finally:
        state.close()
    assert restored.steps == 1
    head = restored.model.get_output_embeddings().weight
    assert head is restored.model.get_input_embeddings().weight  # still tied, not two copies
    for (name, a), b in zip(trained.model.named_parameters(), restored.model.parameters(), strict=True):
        assert torch.equal(a, b), name
    for a, b in zip(trained.optimizer.state.values(), restored.optimizer.state.values(), strict=True):
        assert all(torch.equal(a[k], b[k]) for k in ("exp_avg", "exp_avg_sq", "step"))
    trained.step(build_batch(groups))
    restored.step(build_batch(groups))
    assert all(torch.equal(a, b) for a, b in zip(trained.model.parameters(), restored.model.parameters(), strict=True))
