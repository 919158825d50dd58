"""The Responses and Messages APIs, served by a real server and driven by the real OpenAI and Anthropic SDKs:
each answer is the chat answer of the same conversation, in the API's own shape, with the same token-exact,
signed extension (the shapes and events themselves: ``serving/test_dialects.py``)."""

from __future__ import annotations

import json

import anthropic
import httpx2
import openai
import pytest

from tests.conftest import MESSAGE_TOOLS, RESPONSE_TOOLS, LiveServer
from tests.server.api.calls import ASK, accepted, chat_ext


def test_responses_answer_is_the_chat_answer_with_its_extension(live_server, sdk):
    kw = {"max_output_tokens": 6, "temperature": 1.0, "extra_body": {"seed": 11}}
    reply = sdk.responses.create(model="agentjet-tiny", instructions="Be brief.", input="What is 2 + 3?", **kw)
    chat, ext = chat_ext(
        sdk, messages=[{"role": "system", "content": "Be brief."}, *ASK], max_tokens=6, temperature=1.0, seed=11
    )
    mine = reply.model_extra["agentjet"]
    assert mine["prompt_token_ids"] == ext["prompt_token_ids"]  # the same conversation, rendered the same
    assert mine["completion_token_ids"] == ext["completion_token_ids"]
    assert reply.output_text == (chat.message.content or "")
    assert reply.status == ("incomplete" if chat.finish_reason == "length" else "completed")
    assert reply.usage.output_tokens == len(mine["completion_token_ids"])
    assert reply.usage.input_tokens == len(mine["prompt_token_ids"])
    assert accepted(live_server, mine, "responses") == "accepted"  # signed like any sample


def test_responses_function_calls_round_trip(sdk):
    first = sdk.responses.create(
        model="agentjet-tiny", input=ASK, tools=RESPONSE_TOOLS, max_output_tokens=30, temperature=0.0
    )
    calls = [item for item in first.output if item.type == "function_call"]
    # the tiny model may pick any tool it was warmed up on; the call parses
    assert calls and calls[0].name and isinstance(json.loads(calls[0].arguments), dict), first.output
    assert first.model_extra["agentjet"]["finish_reason"] == "tool_calls"
    history = [*ASK, *[item.model_dump(exclude_none=True) for item in first.output]]
    history.append({"type": "function_call_output", "call_id": calls[0].call_id, "output": "5"})
    second = sdk.responses.create(model="agentjet-tiny", input=history, tools=RESPONSE_TOOLS, max_output_tokens=8)
    ext1, ext2 = first.model_extra["agentjet"], second.model_extra["agentjet"]
    # the second prompt continues the first call's exact tokens (the history renders to them)
    assert ext2["prompt_token_ids"][: len(ext1["prompt_token_ids"])] == ext1["prompt_token_ids"]


def test_responses_sdk_stream_and_refusals(sdk):
    with sdk.responses.stream(model="agentjet-tiny", input="What is 2 + 3?", max_output_tokens=6) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text and final.model_extra["agentjet"]["completion_token_ids"]
    refusals = [
        ({"previous_response_id": "resp_1"}, "keeps no stored responses"),
        ({"conversation": "conv_1"}, "keeps no stored responses"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "item references"),
        ({"tools": [{"type": "web_search"}]}, "function tools only"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "text only"),
        ({"background": True}, "background"),
    ]
    for extra, says in refusals:
        kw = {"model": "agentjet-tiny", "input": "hi", **extra}
        with pytest.raises(openai.BadRequestError, match=says):
            sdk.responses.create(**kw)


def test_messages_answer_is_the_chat_answer(live_server, claude, sdk):
    reply = claude.messages.create(
        model="agentjet-tiny", system="Be brief.", max_tokens=6, messages=ASK, extra_body={"seed": 5}
    )
    chat, ext = chat_ext(sdk, messages=[{"role": "system", "content": "Be brief."}, *ASK], max_tokens=6, seed=5)
    mine = reply.model_extra["agentjet"]
    assert mine["prompt_token_ids"] == ext["prompt_token_ids"]
    assert mine["completion_token_ids"] == ext["completion_token_ids"]
    assert "".join(b.text for b in reply.content if b.type == "text") == (chat.message.content or "")
    assert reply.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[chat.finish_reason]
    assert reply.usage.output_tokens == len(mine["completion_token_ids"])
    assert accepted(live_server, mine, "messages") == "accepted"


def test_messages_tool_use_round_trip_and_stream(claude):
    greedy = {"extra_body": {"temperature": 0.0}}  # this SDK version takes no temperature argument
    first = claude.messages.create(model="agentjet-tiny", max_tokens=30, messages=ASK, tools=MESSAGE_TOOLS, **greedy)
    uses = [b for b in first.content if b.type == "tool_use"]
    assert first.stop_reason == "tool_use" and uses and uses[0].name and isinstance(uses[0].input, dict)
    history = [
        *ASK,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "5"}]},
    ]
    second = claude.messages.create(model="agentjet-tiny", max_tokens=8, messages=history, tools=MESSAGE_TOOLS)
    ext1, ext2 = first.model_extra["agentjet"], second.model_extra["agentjet"]
    assert ext2["prompt_token_ids"][: len(ext1["prompt_token_ids"])] == ext1["prompt_token_ids"]
    with claude.messages.stream(model="agentjet-tiny", max_tokens=30, messages=ASK, tools=MESSAGE_TOOLS, **greedy) as s:
        streamed = s.get_final_message()
    assert next(b.input for b in streamed.content if b.type == "tool_use") == uses[0].input
    assert streamed.stop_reason == "tool_use"


def test_messages_refusals_and_x_api_key(model_dir, claude):
    missing = httpx2.post(
        str(claude.base_url).rstrip("/") + "/v1/messages", json={"model": "agentjet-tiny", "messages": ASK}
    )
    assert missing.status_code == 400 and "'max_tokens' is required" in missing.json()["error"]["message"]
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
    with pytest.raises(anthropic.BadRequestError, match="'image' block"):
        claude.messages.create(model="agentjet-tiny", max_tokens=4, messages=[{"role": "user", "content": [image]}])
    with pytest.raises(anthropic.BadRequestError, match="top_k"):
        claude.messages.create(model="agentjet-tiny", max_tokens=4, messages=ASK, extra_body={"top_k": 5})
    server = LiveServer(model_dir, api_keys=["client-key-123456789"])
    try:
        with anthropic.Anthropic(base_url=server.url, api_key="client-key-123456789") as keyed:
            assert keyed.messages.create(model="agentjet-tiny", max_tokens=3, messages=ASK).model_extra["agentjet"]
        with anthropic.Anthropic(base_url=server.url, api_key="wrong-key-000000000") as wrong:
            with pytest.raises(anthropic.AuthenticationError):
                wrong.messages.create(model="agentjet-tiny", max_tokens=3, messages=ASK)
    finally:
        server.stop()
