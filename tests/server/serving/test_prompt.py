"""A request's way to token ids (``serving.prompt``): chat messages rendered with the model's template, text
prompts tokenised as vLLM does, sampling settings carried over, and every bound (context, completion budget,
token entries, prefix claims) checked before anything is sampled, each refusal naming the field, the figures
and what to change; on the embedded model's real tokenizer and template."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentjet_client.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from agentjet_server.engine.hf import TransformersEngine
from agentjet_server.errors import InvalidRequestError
from agentjet_server.serving.chat_format import forced_tool_prefix
from agentjet_server.serving.prompt import PromptBuilder, message_dicts

ASK = [{"role": "user", "content": "What is 2 + 3?"}]
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[TransformersEngine]:
    served = TransformersEngine(model_dir)
    yield served
    served.close()


@pytest.fixture(scope="module")
def prompts(engine: TransformersEngine) -> PromptBuilder:
    return PromptBuilder(engine, default_max_tokens=64)


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": ASK, **fields})


def refusal(prepare, request) -> InvalidRequestError:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidRequestError) as caught:
        prepare(request)
    return caught.value


def test_a_chat_request_is_rendered_with_the_template_and_sampled_at_temperature_one(prompts, engine):
    prepared = prompts.prepare_chat(chat())
    assert prepared.prompt_ids == engine.render(ASK)
    assert engine.chat.decode_all(prepared.prompt_ids).endswith("<|im_start|>assistant\n")
    params = prepared.params
    assert (params.max_tokens, params.temperature, params.top_p, params.seed, params.stop) == (64, 1.0, 1.0, None, ())
    assert params.top_logprobs == 0 and not prepared.want_logprobs and prepared.agent == "default"
    assert not prepared.tools_active and prepared.forced_prefix == "" and prepared.reader is None
    assert prepared.prefix_status is None and not prepared.prefix_drift


def test_sampling_settings_and_the_agent_carry_over(prompts):
    request = chat(
        temperature=0.3,
        top_p=0.9,
        seed=7,
        stop=["a", "bc"],
        logprobs=True,
        top_logprobs=2,
        max_tokens=9,
        max_completion_tokens=5,  # wins over max_tokens
        agentjet={"agent": "solver"},
    )
    prepared = prompts.prepare_chat(request)
    params = prepared.params
    assert (params.max_tokens, params.temperature, params.top_p, params.seed) == (5, 0.3, 0.9, 7)
    assert params.stop == ("a", "bc") and params.top_logprobs == 2 and prepared.want_logprobs
    assert prepared.agent == "solver"


def test_settings_that_change_the_distribution_carry_over_checked(prompts, engine):
    plain = prompts.prepare_chat(chat(frequency_penalty=0, presence_penalty=0.0, logit_bias={"5": 0}, top_k=-1))
    assert not plain.params.processed  # zeros and "off" values change nothing
    request = chat(
        logit_bias={"7": 2.5, "5": -1},
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        repetition_penalty=1.2,
        top_k=40,
        min_p=0.05,
        min_tokens=2,
        ignore_eos=True,
        max_tokens=8,
    )
    params = prompts.prepare_chat(request).params
    assert params.processed and params.logit_bias == ((5, -1.0), (7, 2.5))
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.5, -0.25, 1.2)
    assert (params.top_k, params.min_p, params.min_tokens, params.ignore_eos) == (40, 0.05, 2, True)
    vocab = len(engine.chat.tokenizer)
    assert refusal(prompts.prepare_chat, chat(logit_bias={str(vocab): 1})).param == "logit_bias"
    assert refusal(prompts.prepare_chat, chat(min_tokens=9, max_tokens=8)).param == "min_tokens"
    exact = PromptBuilder(engine, default_max_tokens=64, exact_sampling=True)
    said = refusal(exact.prepare_chat, chat(top_k=5, presence_penalty=1))
    assert said.param == "presence_penalty" and "--exact-sampling" in said.message and "top_k" in said.message
    assert not exact.prepare_chat(chat(temperature=0.5)).params.processed
    for field, value in [("logit_bias", {"5": 101}), ("logit_bias", {"x": 1}), ("presence_penalty", 2.5)]:
        with pytest.raises(ValueError, match=field):
            chat(**{field: value})


def test_the_default_budget_is_cut_to_what_the_context_leaves(engine):
    prepared = PromptBuilder(engine, default_max_tokens=10**6).prepare_chat(chat())
    assert prepared.params.max_tokens == engine.max_context - len(prepared.prompt_ids)


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_a_completion_budget_past_the_context_is_refused_naming_the_field_and_the_room(prompts, engine, field):
    size = len(engine.render(ASK))
    room = engine.max_context - size
    assert prompts.prepare_chat(chat(**{field: room})).params.max_tokens == room  # the whole room is fine
    error = refusal(prompts.prepare_chat, chat(**{field: room + 1}))
    assert error.message == (
        f"{field} is {room + 1}, but the prompt is {size} tokens and the model's context is {engine.max_context}: "
        f"at most {room} tokens are left for the completion; lower {field}"
    )
    assert error.param == field and error.code == "context_length_exceeded"


def test_a_prompt_that_fills_the_context_is_refused(prompts, engine):
    words = " ".join(f"w{i}" for i in range(engine.max_context))  # fewer characters than the bound, too many tokens
    assert len(words) < prompts.max_prompt_chars
    error = refusal(prompts.prepare_chat, chat(messages=[{"role": "user", "content": words}]))
    assert error.message.startswith("the prompt is ") and error.message.endswith(
        f"tokens but the model's context is {engine.max_context}; shorten the conversation"
    )
    assert error.param == "messages" and error.code == "context_length_exceeded"


def test_text_that_cannot_fit_is_refused_before_it_is_tokenised(prompts, engine):
    bound = prompts.max_prompt_chars
    longest = max(len(t) for t in engine.chat.tokenizer.get_vocab())
    assert bound == engine.max_context * longest  # no token spans more characters than the longest entry
    error = refusal(prompts.prepare_chat, chat(messages=[{"role": "user", "content": "x" * (bound + 1)}]))
    assert error.message == (
        f"the messages hold {bound + 1} characters, more than fit in the model's context of {engine.max_context} "
        f"tokens (at most {bound} characters); shorten the conversation"
    )
    schema = {"type": "object", "description": "y" * bound}
    tools = [{"type": "function", "function": {"name": "big", "parameters": schema}}]
    error = refusal(prompts.prepare_chat, chat(tools=tools))  # the tools' text counts too
    assert error.message.startswith("the messages and tools hold ") and error.param == "messages"


def test_a_request_that_could_sample_too_many_token_entries_is_refused(engine):
    prompts = PromptBuilder(engine, max_token_entries=100)
    assert prompts.prepare_chat(chat(n=2, max_tokens=50)).params.max_tokens == 50  # 100 entries: fine
    error = refusal(prompts.prepare_chat, chat(n=3, max_tokens=50))
    assert error.message.startswith("this request could sample n=3 x 50 tokens (150 token entries)")
    assert error.param == "n" and error.code == "request_too_large"
    error = refusal(prompts.prepare_chat, chat(n=2, max_tokens=20, logprobs=True, top_logprobs=2))
    assert error.message.startswith("this request could sample n=2 x 20 tokens with 2 top log-probs each (120 token")
    assert prompts.prepare_chat(chat(n=2, max_tokens=20, logprobs=False, top_logprobs=2)).want_logprobs is False


def test_tools_are_rendered_and_a_forced_call_is_begun_in_the_prompt(prompts, engine):
    auto = prompts.prepare_chat(chat(tools=TOOLS))
    assert auto.tools_active and auto.forced_prefix == ""
    assert "<tools>" in engine.chat.decode_all(auto.prompt_ids)
    named = {"type": "function", "function": {"name": "add"}}
    forced = prompts.prepare_chat(chat(tools=TOOLS, tool_choice=named))
    assert forced.forced_prefix == forced_tool_prefix(chat(tools=TOOLS, tool_choice=named).tool_choice)
    assert forced.prompt_ids == engine.render(ASK, TOOLS, assistant_prefix=forced.forced_prefix)
    off = prompts.prepare_chat(chat(tools=TOOLS, tool_choice="none"))  # tools listed, none to be called
    assert not off.tools_active and off.prompt_ids == engine.render(ASK)
    error = refusal(prompts.prepare_chat, chat(tool_choice="required"))
    assert error.message == "tool_choice needs a non-empty 'tools' list" and error.param == "tool_choice"


def test_bad_claims_are_400s(prompts, engine):
    vocab = len(engine.chat.tokenizer)
    error = refusal(prompts.prepare_chat, chat(agentjet={"prefix_token_ids": [1, 2], "prefix_prompt_tokens": 2}))
    assert "prefix_prompt_tokens is 2 but prefix_token_ids has only 2 tokens" in error.message
    assert error.param == "agentjet.prefix_prompt_tokens"
    error = refusal(prompts.prepare_chat, chat(agentjet={"prefix_token_ids": [1, vocab], "prefix_prompt_tokens": 1}))
    assert f"outside the vocabulary (0..{vocab - 1})" in error.message and error.param == "agentjet.prefix_token_ids"
    long = [1] * (engine.max_context + 1)
    error = refusal(prompts.prepare_chat, chat(agentjet={"prefix_token_ids": long, "prefix_prompt_tokens": 1}))
    assert error.code == "context_length_exceeded" and f"{engine.max_context + 1} tokens" in error.message


def test_a_continued_call_starts_from_the_earlier_tokens_and_is_counted(engine):
    prompts = PromptBuilder(engine, default_max_tokens=8)
    first = engine.render(ASK)
    answer = [*engine.chat.encode("5"), int(engine.chat.tokenizer.convert_tokens_to_ids("<|im_end|>"))]
    messages = [*ASK, {"role": "assistant", "content": "5"}, {"role": "user", "content": "Sure?"}]
    claim = {"prefix_token_ids": first + answer, "prefix_prompt_tokens": len(first)}
    prepared = prompts.prepare_chat(chat(messages=messages, agentjet=claim))
    assert prepared.prompt_ids[: len(first) + len(answer)] == first + answer and prepared.prefix_status == "extended"
    edited = [*ASK, {"role": "assistant", "content": "6"}, {"role": "user", "content": "Sure?"}]
    fresh = prompts.prepare_chat(chat(messages=edited, agentjet=claim))
    assert fresh.prefix_status == "mismatch" and fresh.prompt_ids == engine.render(edited)
    counts = prompts.context
    assert (counts.prefix_requests, counts.extended, counts.mismatch) == (2, 1, 1)


def test_messages_become_what_chat_templates_read():
    messages = [
        ChatMessage.model_validate(
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
        ),
        ChatMessage.model_validate({"role": "user", "name": "bob", "content": "hi", "reasoning_content": "not mine"}),
        ChatMessage.model_validate(
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "adding",
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}],
            }
        ),
        ChatMessage.model_validate({"role": "tool", "tool_call_id": "c1", "content": "5"}),
    ]
    assert message_dicts(messages) == [
        {"role": "user", "content": "ab"},
        {"role": "user", "content": "hi", "name": "bob"},  # reasoning belongs to assistant turns only
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}],
            "reasoning": "adding",
            "reasoning_content": "adding",  # both names templates read
        },
        {"role": "tool", "content": "5", "tool_call_id": "c1"},
    ]


def test_text_prompts_are_tokenised_as_vllm_does_and_ids_pass_as_they_are(prompts, engine):
    text = "<|im_start|>user\nHi<|im_end|>"
    request = CompletionRequest(prompt=[text, "Once upon"], max_tokens=4, logprobs=2, temperature=0.5, seed=3)
    first, second = prompts.prepare_text(request)
    tokenizer = engine.chat.tokenizer
    assert first.prompt_ids == tokenizer.encode(text)
    specials = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert [first.prompt_ids[0], first.prompt_ids[-1]] == specials  # special tokens in text are parsed as such
    assert second.prompt_ids == tokenizer.encode("Once upon")
    assert first.params.top_logprobs == 2 and first.want_logprobs and first.params.temperature == 0.5
    assert not first.tools_active and first.forced_prefix == ""
    [ids] = prompts.prepare_text(CompletionRequest(prompt=[7, 8, 9]))
    assert ids.prompt_ids == [7, 8, 9] and ids.params.max_tokens == 16 and not ids.want_logprobs


@pytest.mark.parametrize(
    ("prompt", "fields", "says", "param"),
    [
        ([[1, 2], [3, 10**6]], {}, "prompt[1] holds token ids outside the vocabulary (0..", "prompt"),
        ("", {}, "prompt is empty; send some text or token ids", "prompt"),
        ("hello", {"max_tokens": 10**6}, "max_tokens is 1000000; lower max_tokens or shorten the prompt", "max_tokens"),
        ([[1] * 5000], {}, "prompt is 5000 tokens and the model's context is", "max_tokens"),
    ],
)
def test_a_text_prompt_out_of_bounds_is_refused_naming_which(prompts, prompt, fields, says, param):
    error = refusal(prompts.prepare_text, CompletionRequest(prompt=prompt, **fields))
    assert says in error.message and error.param == param


def test_text_that_cannot_fit_and_too_many_entries_are_refused(engine):
    prompts = PromptBuilder(engine, max_token_entries=100)
    error = refusal(prompts.prepare_text, CompletionRequest(prompt="x" * (prompts.max_prompt_chars + 1)))
    assert error.message.startswith(f"prompt holds {prompts.max_prompt_chars + 1} characters, more than fit")
    assert error.code == "context_length_exceeded"
    assert len(prompts.prepare_text(CompletionRequest(prompt=["a", "b"], n=2, max_tokens=25))) == 2  # 100 entries
    error = refusal(prompts.prepare_text, CompletionRequest(prompt=["a", "b"], n=2, max_tokens=25, logprobs=1))
    assert error.message.startswith("this request could sample 200 token entries") and error.code == "request_too_large"
