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


def test_a_temperature_below_the_epsilon_is_greedy_as_in_vllm():
    for tiny in (5e-324, 1e-300, 1e-45, 9.99e-6):
        params = SamplingParams(max_tokens=1, temperature=tiny, top_p=5e-324)
        assert (params.temperature, params.top_p) == (0.0, 1.0)
        assert set(_draws(params, 20)) == {1}
    assert SamplingParams(max_tokens=1, temperature=1e-5, top_p=0.5).temperature == 1e-5


def test_a_row_that_cannot_be_sampled_fails_alone(model_dir):
    """One row whose distribution is not finite (and one whose sampling raises) get an error each; the
    other rows of the batch get their tokens."""
    from agentjet_server.errors import EngineError, InvalidRequestError

    loop = asyncio.new_event_loop()
    chat = ChatTokenizer(model_dir)
    vocab = len(chat.tokenizer)

    rows = [SamplingParams(max_tokens=4, temperature=1.0) for _ in range(4)]
    requests = [
        Request(loop=loop, events=asyncio.Queue(), prompt_ids=[1, 2], params=p, generator=torch.Generator())
        for p in rows
    ]
    requests[3].generator = "not a generator"  # type: ignore[assignment]
    logits = torch.zeros((4, vocab))
    logits[1, 7] = float("inf")  # softmax of this row is nan
    live = [True] * 4
    chosen = Sampler(chat, max_context=64).sample(requests, live, logits, version=3)
    assert live == [True, False, True, False]
    loop.run_until_complete(asyncio.sleep(0))  # the pushes land
    got = [r.events.get_nowait() for r in requests]
    assert got[0].token_id == int(chosen[0]) and got[2].token_id == int(chosen[2])
    assert isinstance(got[1], InvalidRequestError) and got[1].param == "temperature"
    assert isinstance(got[3], EngineError) and "sampling failed" in str(got[3])
    loop.close()
