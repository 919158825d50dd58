"""LoRA in the learner: only the adapter trains, the engine gets exactly the merged model, and the
settings that cannot go together are refused with what to do (a checkpoint's adapter settings on resume:
``test_resume``)."""

import pytest
import torch

from agentjet_server.engine.adapter import LoraSpec
from agentjet_server.engine.lora_layers import attach
from agentjet_server.learner.lora import adapter_state, merged
from agentjet_server.learner.trainer import Learner, LearnerConfig
from agentjet_server.settings import ServerSettings


def _model(model_dir, tied=False):
    from transformers import AutoConfig, AutoModelForCausalLM

    if not tied:
        return AutoModelForCausalLM.from_pretrained(model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    config.tie_word_embeddings = True
    return AutoModelForCausalLM.from_config(config)


def test_only_the_adapter_trains_and_the_merged_weights_are_what_the_adapted_model_computes(model_dir):
    from transformers import AutoModelForCausalLM

    from agentjet_server.learner.batch import Batch, Sequence

    model = _model(model_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    learner = Learner(model, LearnerConfig(lr=1e-2, lora=LoraSpec(rank=4, alpha=8.0)), pad_id=0)
    total = sum(p.numel() for p in model.parameters())
    assert 0 < learner.trainable_parameters < 0.1 * total
    sequences = [
        Sequence(list(range(5 + i, 25 + i)), list(range(10, 20)), [-2.0] * 10, [1.0 if i else -1.0] * 10)
        for i in range(2)
    ]
    learner.step(Batch(sequences, [0.0, 1.0], 1, 0, 2))
    state = model.state_dict()
    # the base weights did not move; the adapter did
    assert all(torch.equal(state[k], v) for k, v in before.items() if k in state)
    assert any(float(v.abs().max()) > 0 for k, v in adapter_state(state).items() if ".lora_B." in k)
    plain = AutoModelForCausalLM.from_pretrained(model_dir)
    plain.load_state_dict(learner.full_state_dict(), strict=True)  # the base model's names, nothing else
    ids = torch.tensor([[1, 5, 9, 40, 77, 3, 12]])
    with torch.no_grad():
        assert float((plain(input_ids=ids).logits - model(input_ids=ids).logits).abs().max()) < 1e-5


def test_all_linear_resolves_to_the_decoder_layers_and_takes_more_names(model_dir):
    model = _model(model_dir)
    names = LoraSpec(rank=2, alpha=4.0).target_modules(model)
    assert "q_proj" in names and "down_proj" in names and "lm_head" not in names
    assert "lm_head" in LoraSpec(rank=2, alpha=4.0, targets="all-linear,lm_head").target_modules(model)


def test_an_adapter_on_a_tied_output_head_is_refused(model_dir):
    with pytest.raises(ValueError, match="shares its weights with the input embeddings"):
        attach(_model(model_dir, tied=True), LoraSpec(rank=2, alpha=4.0, targets="all-linear,lm_head"))


def test_a_target_that_matches_nothing_is_refused(model_dir):
    with pytest.raises(ValueError, match="--lora-targets nothing_here"):
        attach(_model(model_dir), LoraSpec(rank=2, alpha=4.0, targets="nothing_here"))


def test_lora_flags_without_a_rank_are_refused():
    with pytest.raises(ValueError, match="add --lora-rank"):
        ServerSettings(lora_alpha=16)


def test_merging_folds_each_adapter_into_its_base_weight():
    base = torch.randn(6, 4)
    a, b = torch.randn(2, 4), torch.randn(6, 2)
    state = {
        "x.q_proj.base_layer.weight": base,
        "x.q_proj.base_layer.bias": torch.ones(6),
        "x.q_proj.lora_A.default.weight": a,
        "x.q_proj.lora_B.default.weight": b,
        "x.norm.weight": torch.ones(4),
    }
    out = merged(state, LoraSpec(rank=2, alpha=3.0))
    assert set(out) == {"x.q_proj.weight", "x.q_proj.bias", "x.norm.weight"}
    assert torch.allclose(out["x.q_proj.weight"], base + 1.5 * (b @ a))
