"""The learner's attention (``learner.policy``): repeating grouped key/value heads changes no
log-prob and no gradient, chain by chain (a cache of ancestors' keys and values) and as one dense tree.

On a GPU in fp32 this is the path every learner step takes (transformers' grouped SDPA would fall
back to the quadratic math kernel there); on CPU the learner keeps transformers' own, so the
repeated path is registered here under its own name to compare the two on the same model.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch

from agentjet_server.learner.batch import Sequence
from agentjet_server.learner.packing import pack
from agentjet_server.learner.policy import NAME, learner_sdpa, register
from agentjet_server.learner.trainer import Learner, LearnerConfig


def _sequences(rng: random.Random, vocab: int) -> list[Sequence]:
    prompt = [rng.randrange(vocab) for _ in range(40)]
    out = []
    for _ in range(6):  # siblings sharing the prompt: a tree whose chains continue the prompt's keys
        tokens = prompt + [rng.randrange(vocab) for _ in range(rng.randint(5, 30))]
        positions = list(range(len(prompt), len(tokens)))
        out.append(Sequence(tokens, positions, [-3.0] * len(positions), [rng.uniform(-1, 1) for _ in positions]))
    return out


def _run(
    model: torch.nn.Module, sequences: list[Sequence], mode: str, attention: str
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    learner = Learner(model, LearnerConfig(), pad_id=0)
    model.set_attn_implementation(attention)  # type: ignore[operator]  # after the learner's own choice
    model.zero_grad()
    out = []
    for micro in pack(sequences, 4096):
        batch = micro.tensors(torch.device("cpu"), mode)
        logprobs, _ = learner.sequence_logprobs(batch)
        out.append(logprobs)
    logprobs = torch.cat(out)
    (-(logprobs.exp() * torch.linspace(-1, 1, len(logprobs))).sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logprobs.detach(), grads


@pytest.mark.parametrize("mode", ["segments", "dense"])
def test_repeated_heads_change_no_logprob_or_gradient(model_dir, mode):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # grouped: the case at stake
    sequences = _sequences(random.Random(0), model.config.vocab_size)

    want, want_grads = _run(model, sequences, mode, "sdpa")
    # each sequence alone, no packing, no cache: the values both must compute (in another order)
    with torch.no_grad():
        alone = []
        for seq in sequences:
            logp = torch.log_softmax(model(input_ids=torch.tensor([seq.tokens])).logits[0].float(), -1)
            idx = torch.tensor(seq.positions)
            alone.append(logp[idx - 1].gather(-1, torch.tensor(seq.tokens)[idx].unsqueeze(-1)).squeeze(-1))
    assert float((want.sort().values - torch.cat(alone).sort().values).abs().max()) <= 1e-5
    register("repeated_kv_sdpa", functools.partial(learner_sdpa, repeat_heads=True))
    calls = []
    handle = torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, value, **kwargs):  # type: ignore[no-untyped-def]
        calls.append((query.shape[1], key.shape[1], kwargs.get("enable_gqa", False)))
        return handle(query, key, value, **kwargs)

    torch.nn.functional.scaled_dot_product_attention = spy
    try:
        got, got_grads = _run(model, sequences, mode, "repeated_kv_sdpa")
    finally:
        torch.nn.functional.scaled_dot_product_attention = handle
    # every call got as many key/value heads as query heads, and none asked for grouped attention
    assert calls and all(q == k and not gqa for q, k, gqa in calls), calls[:3]
    assert float((got - want).abs().max()) <= 1e-5
    scale = max(float(g.abs().max()) for g in want_grads.values())
    assert scale > 1e-3  # real gradients
    worst = max(float((got_grads[n] - g).abs().max()) for n, g in want_grads.items())
    assert worst <= 1e-5 * scale, f"gradients differ by {worst} (largest {scale})"


def test_learner_switches_sdpa_models_and_keeps_them_saveable(model_dir, tmp_path):
    import json

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert model.config._attn_implementation == "sdpa"
    Learner(model, LearnerConfig(), pad_id=0)
    assert model.config._attn_implementation == NAME
    for layer in model.model.layers:
        assert layer.self_attn.config._attn_implementation == NAME
    # on CPU it is transformers' SDPA unchanged; a saved checkpoint loads anywhere (the name is not saved)
    model.save_pretrained(tmp_path)
    assert NAME not in json.dumps(json.loads((tmp_path / "config.json").read_text()))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    assert torch.equal(model(input_ids=ids).logits, reloaded(input_ids=ids).logits)
    # an eager model (or any other choice) is left as the user set it
    eager = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    Learner(eager, LearnerConfig(), pad_id=0)
    assert eager.config._attn_implementation == "eager"


def test_learner_sdpa_repeats_heads_only_for_fp32_on_cuda():
    class Attention(torch.nn.Module):
        num_key_value_groups = 2
        is_causal = True

    query, key = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8)
    out, _ = learner_sdpa(Attention(), query, key, key.clone(), None)  # CPU: transformers' own, grouped
    expected = torch.nn.functional.scaled_dot_product_attention(query, key, key, is_causal=True, enable_gqa=True)
    assert torch.allclose(out, expected.transpose(1, 2), atol=1e-6)
