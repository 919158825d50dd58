"""Text completions (``serving.text``): prompts as text or token ids, no chat template; the answer to the
rendered chat prompt is the chat answer; several prompts and n choices each; the legacy log-probability
shape (tokens, their log-probs, top ones, text offsets), whole and streamed token by token, the stream
adding up to the whole answer. The service on the embedded model, and through the real OpenAI SDK."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from agentjet_client.protocol import CompletionRequest, TextCompletion
from agentjet_server.engine.base import EngineOptions
from agentjet_server.engine.hf import TransformersEngine
from agentjet_server.errors import InvalidRequestError
from agentjet_server.serving import PromptBuilder, Sampler, TextService
from tests.server.api.calls import ASK, accepted, chat_ext


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[TransformersEngine]:
    served = TransformersEngine(model_dir, EngineOptions(model_name="agentjet-tiny"))
    yield served
    served.close()


@pytest.fixture(scope="module")
def text(engine: TransformersEngine) -> TextService:
    return TextService(PromptBuilder(engine), Sampler(engine))


def complete(text: TextService, **fields: object) -> TextCompletion:
    return asyncio.run(text.complete(CompletionRequest.model_validate(fields), "agentjet-tiny"))


def streamed(text: TextService, **fields: object) -> tuple[list[str], list[dict]]:  # type: ignore[type-arg]
    """The stream's frames as sent, and the chunks they carry."""

    async def frames() -> list[str]:
        request = CompletionRequest.model_validate({**fields, "stream": True})
        return [frame async for frame in text.stream(request, "agentjet-tiny")]

    sent = asyncio.run(frames())
    chunks = [json.loads(f.removeprefix("data: ")) for f in sent if f.startswith("data: {")]
    return sent, chunks


def test_log_probs_come_in_the_legacy_shape_with_offsets_into_the_text(text, engine):
    reply = complete(text, prompt="Once upon", max_tokens=8, seed=6, logprobs=2)
    [choice] = reply.choices
    logprobs, ext = choice.logprobs, choice.agentjet
    assert logprobs is not None and ext is not None
    assert logprobs.tokens == [engine.decode([t]) for t in ext.completion_token_ids]
    assert logprobs.token_logprobs == ext.completion_logprobs
    assert logprobs.text_offset == list(itertools.accumulate((len(t) for t in logprobs.tokens[:-1]), initial=0))
    assert "".join(logprobs.tokens) == choice.text  # cut at max_tokens: every token is text
    assert logprobs.top_logprobs is not None
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert len(top) == 2  # the two most likely tokens, the sampled one among them or below them
        assert logprob <= max(top.values()) + 1e-6 and (token not in top or top[token] == pytest.approx(logprob))
    assert choice.finish_reason == "length" and reply.usage.completion_tokens == 8
    assert reply.usage.prompt_tokens == len(ext.prompt_token_ids) == len(engine.chat.tokenizer.encode("Once upon"))
    plain = complete(text, prompt="Once upon", max_tokens=8, seed=6, logprobs=0).choices[0].logprobs
    assert plain is not None and plain.top_logprobs is None and plain.tokens == logprobs.tokens
    assert complete(text, prompt="Once upon", max_tokens=8, seed=6).choices[0].logprobs is None


def test_echo_scores_the_prompt_with_the_models_own_log_probs_and_max_tokens_0_samples_nothing(text, engine):
    import torch

    ids = engine.chat.tokenizer.encode("Once upon a time there was")
    with torch.no_grad():
        logits = engine.model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
    reply = complete(text, prompt=ids, max_tokens=0, echo=True, logprobs=0)
    [choice] = reply.choices
    assert choice.logprobs is not None and choice.finish_reason == "length" and choice.agentjet is None
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.token_logprobs[1:] == pytest.approx(expected)
    assert choice.text == engine.chat.decode_all(ids) == "".join(choice.logprobs.tokens)
    assert reply.usage.completion_tokens == 0 and reply.usage.prompt_tokens == reply.usage.total_tokens == len(ids)
    # with a completion: the prompt's entries, then the sampled tokens' (the same as without echo)
    both = complete(text, prompt="Once upon", max_tokens=4, seed=3, echo=True, logprobs=1).choices[0]
    alone = complete(text, prompt="Once upon", max_tokens=4, seed=3, logprobs=1).choices[0]
    assert both.text == "Once upon" + alone.text and alone.logprobs is not None and both.logprobs is not None
    prompt_len = len(engine.chat.tokenizer.encode("Once upon"))
    assert both.logprobs.token_logprobs[prompt_len:] == alone.logprobs.token_logprobs
    assert both.logprobs.tokens[prompt_len:] == alone.logprobs.tokens
    assert both.logprobs.text_offset[prompt_len:] == [o + len("Once upon") for o in alone.logprobs.text_offset]
    assert both.logprobs.top_logprobs is not None and both.logprobs.top_logprobs[0] is None
    # echo without logprobs: the text only, and no scoring pass
    assert complete(text, prompt="Once upon", max_tokens=2, seed=3, echo=True).choices[0].text.startswith("Once upon")


def test_each_prompt_gets_n_choices_in_order_and_its_prompt_is_counted_once(text, engine):
    reply = complete(text, prompt=["Hello", "World"], n=2, max_tokens=3, seed=1)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    prompts = [c.agentjet.prompt_token_ids for c in reply.choices if c.agentjet is not None]
    hello, world = engine.chat.tokenizer.encode("Hello"), engine.chat.tokenizer.encode("World")
    assert prompts == [hello, hello, world, world]
    assert reply.usage.prompt_tokens == len(hello) + len(world)
    assert reply.usage.completion_tokens == sum(len(c.agentjet.completion_token_ids) for c in reply.choices)


def test_a_stream_adds_up_to_the_whole_answer_token_by_token_with_its_log_probs(text):
    kw = {"prompt": ["Once upon", "Far away"], "n": 2, "max_tokens": 8, "seed": 6, "logprobs": 1}
    whole = complete(text, **kw)
    sent, chunks = streamed(text, **kw, stream_options={"include_usage": True})
    assert sent[0] == "" and sent[-1] == "data: [DONE]\n\n"  # "" first: the route starts the 200 then
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"] == whole.usage.model_dump()
    assert len({c["id"] for c in chunks}) == 1
    for choice in whole.choices:
        mine = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["index"] == choice.index]
        assert len(mine) >= 4  # token by token, not one buffered answer
        assert "".join(c["text"] for c in mine) == choice.text
        parts = [c["logprobs"] for c in mine if "logprobs" in c]
        assert choice.logprobs is not None
        assert [t for p in parts for t in p["tokens"]] == choice.logprobs.tokens
        assert [lp for p in parts for lp in p["token_logprobs"]] == choice.logprobs.token_logprobs
        assert [o for p in parts for o in p["text_offset"]] == choice.logprobs.text_offset
        last = mine[-1]  # the extension and the finish reason come last, once
        assert [c for c in mine if "agentjet" in c] == [last] and last["finish_reason"] == choice.finish_reason
        assert last["agentjet"]["completion_token_ids"] == choice.agentjet.completion_token_ids
    sent, chunks = streamed(text, prompt="Once upon", max_tokens=2)
    assert all(c["usage"] is None for c in chunks if "usage" in c) and sent[-1] == "data: [DONE]\n\n"


def test_a_bad_request_is_refused_before_the_stream_starts(text):
    async def first_frame() -> str:
        request = CompletionRequest(prompt=[10**6], stream=True)
        return await anext(text.stream(request, "agentjet-tiny"))

    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        asyncio.run(first_frame())


def test_completions_of_the_rendered_prompt_are_the_chat_answer(live_server, sdk):
    chat, ext = chat_ext(sdk, messages=ASK, max_tokens=6, seed=9, logprobs=True)
    text = live_server.engine.chat.decode_all(ext["prompt_token_ids"])
    reply = sdk.completions.create(model="agentjet-tiny", prompt=text, max_tokens=6, seed=9, logprobs=2)
    choice = reply.choices[0]
    mine = choice.model_extra["agentjet"]
    assert mine["prompt_token_ids"] == ext["prompt_token_ids"]  # special tokens in the text are parsed as such
    assert mine["completion_token_ids"] == ext["completion_token_ids"] and choice.text == (chat.message.content or "")
    assert len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs) == reply.usage.completion_tokens
    assert choice.logprobs.token_logprobs == pytest.approx(ext["completion_logprobs"])
    assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs)
    assert accepted(live_server, mine, "completions") == "accepted"
    by_ids = sdk.completions.create(model="agentjet-tiny", prompt=ext["prompt_token_ids"], max_tokens=6, seed=9)
    assert by_ids.choices[0].model_extra["agentjet"]["completion_token_ids"] == ext["completion_token_ids"]


def test_completions_several_prompts_stream_and_refusals(sdk):
    many = sdk.completions.create(model="agentjet-tiny", prompt=["Hello", "World"], n=2, max_tokens=3, seed=1)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    kw = {"model": "agentjet-tiny", "prompt": "Once upon", "max_tokens": 8, "seed": 6}
    whole = sdk.completions.create(**kw).choices[0]
    parts, ext, usage = [], None, None
    for chunk in sdk.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        usage = chunk.usage or usage
        for c in chunk.choices:
            parts.append(c.text)
            ext = c.model_extra.get("agentjet") or ext
    assert (
        "".join(parts) == whole.text
        and ext["completion_token_ids"] == whole.model_extra["agentjet"]["completion_token_ids"]
    )
    assert usage.completion_tokens == len(ext["completion_token_ids"])
    refused = [({"echo": True, "stream": True}, "echo is answered whole"), ({"max_tokens": 0}, "echo true")]
    for extra, says in [*refused, ({"suffix": "x"}, "suffix"), ({"best_of": 2}, "best_of")]:
        with pytest.raises(openai.BadRequestError, match=says):
            sdk.completions.create(**{**kw, **extra})
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        sdk.completions.create(model="agentjet-tiny", prompt=[10**7], max_tokens=2)
    # a list of token ids is one prompt, however long; 65 prompts are too many
    long = sdk.completions.create(model="agentjet-tiny", prompt=[5] * 100, max_tokens=2)
    assert long.choices[0].model_extra["agentjet"]["prompt_token_ids"] == [5] * 100
    with pytest.raises(openai.BadRequestError, match="1 to 64 prompts"):
        sdk.completions.create(model="agentjet-tiny", prompt=["Hi"] * 65, max_tokens=2)
