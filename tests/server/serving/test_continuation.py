"""Token-in/token-out across turns, on the embedded model's real tokenizer and chat template,
and end to end through the OpenAI SDK against a real server."""

from __future__ import annotations

import itertools

import httpx2
import pytest

from agentjet_client import SwarmClient
from agentjet_server.batching.timeline import build_timelines
from agentjet_server.engine.tokens import ChatTokenizer
from agentjet_server.serving.continuation import continue_from

USER = {"role": "user", "content": "Write seven as a digit."}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def chat(model_dir):  # type: ignore[no-untyped-def]
    return ChatTokenizer(model_dir)


def end_of_turn(chat: ChatTokenizer) -> int:
    return int(chat.tokenizer.convert_tokens_to_ids("<|im_end|>"))


def spelled_out(chat: ChatTokenizer, text: str) -> list[int]:
    """``text`` as one token per character: what a sampling model may produce, never what encode gives."""
    return [chat.encode(ch)[0] for ch in text]


def test_a_re_tokenised_answer_is_continued_from_the_sampled_tokens(chat):
    prompt = chat.render([USER])
    sampled = [*spelled_out(chat, "seven is 7"), end_of_turn(chat)]
    assert sampled[:-1] != chat.encode("seven is 7")  # re-tokenising would change the tokens
    messages = [USER, {"role": "assistant", "content": "seven is 7"}, {"role": "user", "content": "Again."}]
    fresh = chat.render(messages)
    assert fresh[: len(prompt) + len(sampled)] != prompt + sampled  # the drift, without the fix

    result = continue_from(chat, prompt + sampled, len(prompt), messages, None)
    assert result.status == "extended" and result.drift
    assert result.prompt_ids[: len(prompt) + len(sampled)] == prompt + sampled
    assert chat.decode_all(result.prompt_ids) == chat.decode_all(fresh)  # same text, the sampled tokens


def test_a_tool_call_re_serialised_differently_is_spliced(chat):
    prompt = chat.render([USER], TOOLS)
    sampled = [*chat.encode('<tool_call>{"name":"add","arguments":{"a":3,"b":4}}</tool_call>'), end_of_turn(chat)]
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 3, "b": 4}'}}
    messages = [USER, {"role": "assistant", "content": None, "tool_calls": [call]}]
    messages.append({"role": "tool", "tool_call_id": "call_1", "content": "7"})
    result = continue_from(chat, prompt + sampled, len(prompt), messages, TOOLS)
    assert result.status == "spliced" and result.drift
    assert result.prompt_ids[: len(prompt) + len(sampled)] == prompt + sampled
    rest = chat.decode_all(result.prompt_ids[len(prompt) + len(sampled) :])
    assert rest == "\n<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\n"

    other = {**call, "function": {"name": "add", "arguments": '{"a": 3, "b": 5}'}}  # not what was sampled
    edited = [USER, {"role": "assistant", "content": None, "tool_calls": [other]}, messages[2]]
    result = continue_from(chat, prompt + sampled, len(prompt), edited, TOOLS)
    assert result.status == "mismatch" and result.prompt_ids == chat.render(edited, TOOLS)


def test_a_call_continuing_a_spliced_call_is_spliced_too(chat):
    """Three calls: the first answer's sampled text renders otherwise (text after the tool call moves
    before it), so the second call's prompt is spliced; the third continues the second, whose prompt
    holds that sampled text, and must be spliced as well (it once rendered afresh: a new timeline)."""
    first = chat.render([USER], TOOLS)
    sampled = '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call> then seven'
    answer1 = [*chat.encode(sampled), end_of_turn(chat)]
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 3, "b": 4}'}}
    assistant1 = {"role": "assistant", "content": "then seven", "tool_calls": [call]}
    messages = [USER, assistant1, {"role": "tool", "tool_call_id": "c1", "content": "7"}]
    assert not chat.render_text(messages, TOOLS).startswith(chat.decode_all(first + answer1))  # it renders otherwise
    second = continue_from(chat, first + answer1, len(first), messages, TOOLS)
    assert second.status == "spliced"

    answer2 = [*spelled_out(chat, "It is 7."), end_of_turn(chat)]
    messages3 = [*messages, {"role": "assistant", "content": "It is 7."}, {"role": "user", "content": "Sure?"}]
    prefix = second.prompt_ids + answer2
    third = continue_from(chat, prefix, len(second.prompt_ids), messages3, TOOLS)
    assert third.status == "spliced" and third.drift
    assert third.prompt_ids[: len(prefix)] == prefix
    assert (
        chat.decode_all(third.prompt_ids[len(prefix) :])
        == "\n<|im_start|>user\nSure?<|im_end|>\n<|im_start|>assistant\n"
    )

    # the first answer edited in the third call's history: not the sampled conversation any more
    edited = [{**m, "content": "then eight"} if m is assistant1 else m for m in messages3]
    result = continue_from(chat, prefix, len(second.prompt_ids), edited, TOOLS)
    assert result.status == "mismatch" and result.prompt_ids == chat.render(edited, TOOLS)


def test_a_tool_call_cut_off_by_max_tokens_is_spliced_and_closed_by_the_template(chat):
    """The tiny model often writes past its tool call until max_tokens stops it: no end-of-turn was
    sampled. The answer sent back renders otherwise (the text after the call moves before it), and
    the continuation is the sampled tokens, then the template's end-of-turn as context."""
    prompt = chat.render([USER], TOOLS)
    sampled = chat.encode('<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call> {"na')
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 3, "b": 4}'}}
    messages = [USER, {"role": "assistant", "content": '{"na', "tool_calls": [call]}]
    messages.append({"role": "tool", "tool_call_id": "c1", "content": "7"})
    assert not chat.render_text(messages, TOOLS).startswith(chat.decode_all(prompt + sampled))
    result = continue_from(chat, prompt + sampled, len(prompt), messages, TOOLS)
    assert result.status == "spliced"
    assert result.prompt_ids[: len(prompt) + len(sampled)] == prompt + sampled
    rest = chat.decode_all(result.prompt_ids[len(prompt) + len(sampled) :])
    assert rest == "<|im_end|>\n<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\n"

    # and the call after it, whose prompt holds that cut-off answer, continues it too
    answer = [*chat.encode("It is 7."), end_of_turn(chat)]
    later = [*messages, {"role": "assistant", "content": "It is 7."}, {"role": "user", "content": "Sure?"}]
    third = continue_from(chat, result.prompt_ids + answer, len(result.prompt_ids), later, TOOLS)
    assert third.status in ("extended", "spliced")
    assert third.prompt_ids[: len(result.prompt_ids) + len(answer)] == result.prompt_ids + answer


def test_a_tool_call_ended_by_another_stop_token_is_spliced_and_so_is_the_call_after_it(chat):
    """The model may end an answer with <|endoftext|>, not the template's <|im_end|>, even inside an
    unclosed <tool_call> (the server reads the call all the same): a CI run of the LangChain example met
    it. The next call sends that call back; it continues the sampled tokens, and so does the one after."""
    prompt = chat.render([USER], TOOLS)
    endoftext = int(chat.tokenizer.convert_tokens_to_ids("<|endoftext|>"))
    assert endoftext in chat.stop_ids and endoftext != end_of_turn(chat)
    sampled = [*chat.encode('<tool_call>{"name": "add", "arguments": {"a": 5, "b": 4}}'), endoftext]
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 5, "b": 4}'}}
    messages = [USER, {"role": "assistant", "content": None, "tool_calls": [call]}]
    messages.append({"role": "tool", "tool_call_id": "c1", "content": "9"})
    result = continue_from(chat, prompt + sampled, len(prompt), messages, TOOLS)
    assert result.status == "spliced" and result.drift
    assert result.prompt_ids[: len(prompt) + len(sampled)] == prompt + sampled
    rest = chat.decode_all(result.prompt_ids[len(prompt) + len(sampled) :])
    assert rest == "\n<|im_start|>tool\n9<|im_end|>\n<|im_start|>assistant\n"

    answer = [*chat.encode("It is 9."), end_of_turn(chat)]
    later = [*messages, {"role": "assistant", "content": "It is 9."}, {"role": "user", "content": "Sure?"}]
    third = continue_from(chat, result.prompt_ids + answer, len(result.prompt_ids), later, TOOLS)
    assert third.status == "spliced"
    assert third.prompt_ids[: len(result.prompt_ids) + len(answer)] == result.prompt_ids + answer


def test_an_edited_history_is_rendered_afresh(chat):
    prompt = chat.render([USER])
    sampled = [*chat.encode("7"), end_of_turn(chat)]
    edited = [USER, {"role": "assistant", "content": "8"}, {"role": "user", "content": "Sure?"}]
    result = continue_from(chat, prompt + sampled, len(prompt), edited, None)
    assert result.status == "mismatch" and not result.drift and result.prompt_ids == chat.render(edited)


@pytest.mark.parametrize("stream", [False, True])
def test_multi_turn_sdk_agent_trains_one_timeline_with_the_sampled_tokens(live_server, stream):
    """Five turns through the unmodified OpenAI SDK: every turn continues the previous one token for
    token, so the episode merges into one timeline whose trained tokens are the sampled ones."""
    before = httpx2.get(live_server.url + "/v1/status").json()["context"]
    with SwarmClient(live_server.url) as client:
        episode = client.episode("multi-turn")
        llm = episode.openai()
        messages = [USER]
        for k in range(5):
            kw = {"model": "agentjet-tiny", "messages": messages, "max_tokens": 12, "temperature": 1.0, "seed": k}
            if stream:
                text = "".join(c.choices[0].delta.content or "" for c in llm.chat.completions.create(stream=True, **kw))
            else:
                text = llm.chat.completions.create(**kw).choices[0].message.content or ""
            messages = [*messages, {"role": "assistant", "content": text}, {"role": "user", "content": "Again."}]
        episode.close()
        trajectory = episode.to_trajectory(1.0)
    turns = trajectory.turns
    assert len(turns) == 5
    for earlier, later in itertools.pairwise(turns):
        prefix = earlier.prompt_token_ids + earlier.completion_token_ids
        assert later.prompt_token_ids[: len(prefix)] == prefix  # no drift in what is trained
    [timeline] = build_timelines(turns)
    assert [timeline.tokens[p] for p in timeline.trained] == [t for turn in turns for t in turn.completion_token_ids]
    after = httpx2.get(live_server.url + "/v1/status").json()["context"]
    assert after["prefix_requests"] - before["prefix_requests"] == 4
    assert after["mismatch"] == before["mismatch"]
    prevented = after["drift_prevented"] - before["drift_prevented"]
    print(f"multi-turn (stream={stream}): drift prevented in {prevented} of 4")
