"""How the transformers engine picks tokens (``engine/hf_sampling.py``): greedy, top-p against a naive
nucleus on hand-made logits, seeds, and the finish reasons."""

import asyncio

import torch

from agentjet_server.engine.base import SamplingParams
from agentjet_server.engine.hf_sampling import Request, Sampler
from agentjet_server.engine.tokens import ChatTokenizer

PROBS = torch.tensor([0.05, 0.5, 0.15, 0.3])


def _nucleus(probs: torch.Tensor, top_p: float) -> set[int]:
    """The smallest set of the most likely tokens whose mass reaches ``top_p``, one token at a time."""
    kept, mass = set(), 0.0
    for token in sorted(range(len(probs)), key=lambda t: -float(probs[t])):
        if mass >= top_p:
            break
        kept.add(token)
        mass += float(probs[token])
    return kept


def _draws(params: SamplingParams, n: int, seed: int = 0) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return [Sampler.pick(PROBS.log(), params, generator) for _ in range(n)]


def test_temperature_zero_is_the_argmax():
    assert set(_draws(SamplingParams(max_tokens=1, temperature=0.0), 20)) == {1}


def test_top_p_samples_only_the_nucleus_and_all_of_it():
    for top_p in (0.4, 0.7, 0.9, 1.0):
        drawn = set(_draws(SamplingParams(max_tokens=1, top_p=top_p), 400))
        assert drawn == _nucleus(PROBS, top_p), top_p


def test_the_same_seed_draws_the_same_tokens():
    params = SamplingParams(max_tokens=1, temperature=0.8)
    assert _draws(params, 50, seed=3) == _draws(params, 50, seed=3) != _draws(params, 50, seed=4)


def test_a_completion_finishes_at_an_end_token_a_stop_string_its_length_or_the_context(model_dir):
    loop = asyncio.new_event_loop()  # where the tokens would go; finish_reason sends none

    def _request(prompt: list[int], params: SamplingParams) -> Request:
        return Request(loop=loop, events=asyncio.Queue(), prompt_ids=prompt, params=params, generator=torch.Generator())

    chat = ChatTokenizer(model_dir)
    sampler = Sampler(chat, max_context=12)
    end = next(iter(chat.stop_ids))
    word = chat.encode(" hello")
    request = _request([1, 2, 3], SamplingParams(max_tokens=5, stop=("hello",)))
    assert sampler.finish_reason(request, end) == "stop"
    request.output_ids = list(word)
    assert sampler.finish_reason(request, word[-1]) == "stop"
    plain = chat.encode(" a b c d e")
    request = _request([1, 2, 3], SamplingParams(max_tokens=len(plain)))
    request.output_ids = plain[:-1]
    assert sampler.finish_reason(request, plain[-2]) is None
    request.output_ids = plain
    assert sampler.finish_reason(request, plain[-1]) == "length"
    request = _request(list(range(10)), SamplingParams(max_tokens=100))
    request.output_ids = plain[:2]
    assert sampler.finish_reason(request, plain[1]) == "length"  # 10 + 2 tokens fill the context of 12
    loop.close()
