"""A model whose output head is tied to its input embedding: vLLM keeps a separately packed copy of
the head on CPU, which the weight loader must rebuild after an update."""

from __future__ import annotations

import asyncio

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


def test_tied_head_follows_the_new_embedding_after_an_update(model_dir, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from agentjet_server.engine.base import SamplingParams
    from agentjet_server.engine.vllm import VLLMEngine

    config = AutoConfig.from_pretrained(model_dir)
    config.tie_word_embeddings = True
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(tmp_path)
    with torch.no_grad():
        for param in model.parameters():  # tied: the head moves with the embedding
            param.add_(0.05 * torch.randn_like(param))
    engine = VLLMEngine(tmp_path)
    try:
        engine.update_weights(model.state_dict(), 1)
        ids = engine.render([{"role": "user", "content": "Say something."}])

        async def sample() -> list:
            return [e async for e in engine.generate(ids, SamplingParams(max_tokens=30, seed=4))]

        events = asyncio.run(sample())
    finally:
        engine.close()
    tokens = [e.token_id for e in events]
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([ids + tokens])).logits[0], -1)
    want = [float(logp[len(ids) - 1 + j, t]) for j, t in enumerate(tokens)]
    assert {e.version for e in events} == {1}
    assert max(abs(e.logprob - w) for e, w in zip(events, want, strict=True)) < 1e-3
