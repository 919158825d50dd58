"""Answers in the Responses and Messages shapes (``serving.dialects``): a chat completion (or its stream of
chunks) written back as a Responses object and its numbered events, or as an Anthropic message and its
events, each carrying the chat choice's ``agentjet`` extension. The shaping on hand-made chat answers, then
the events a real server streams."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx2
import pytest

from agentjet_client.protocol import (
    AgentJetExtension,
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    Choice,
    ChoiceDelta,
    ChunkChoice,
    FunctionCall,
    ToolCall,
    ToolCallDelta,
)
from agentjet_server.errors import InvalidRequestError
from agentjet_server.serving.dialects import (
    matched_stop,
    message_error_event,
    message_events,
    message_object,
    response_error_event,
    response_events,
    response_object,
)
from tests.server.api.calls import sse_events

# a tiny vocabulary for the hand-made answers: token id -> text (100 ends the turn)
VOCAB = {10: "It", 11: " is", 12: " 5", 13: ".", 14: "END", 15: "xx", 100: ""}


def decode(ids: list[int]) -> str:
    return "".join(VOCAB[i] for i in ids)


def ext(finish: str = "stop", completion: tuple[int, ...] = (10, 11, 12, 13, 100)) -> AgentJetExtension:
    n = len(completion)
    return AgentJetExtension(
        prompt_token_ids=[1, 2, 3],
        completion_token_ids=list(completion),
        completion_logprobs=[-0.5] * n,
        completion_versions=[4] * n,
        finish_reason=finish,  # type: ignore[arg-type]
        policy_version=4,
        signature="ab" * 24,
    )


CALLS = [
    ToolCall(id="call_1", function=FunctionCall(name="add", arguments='{"x": 2}')),
    ToolCall(id="call_2", function=FunctionCall(name="now", arguments="")),
]


def completion(
    content: str | None, reasoning: str | None = None, calls: list[ToolCall] | None = None, finish: str = "stop"
) -> ChatCompletion:
    message = AssistantMessage(content=content, reasoning=reasoning, reasoning_content=reasoning, tool_calls=calls)
    choice = Choice(index=0, message=message, finish_reason=finish, agentjet=ext(finish))  # type: ignore[arg-type]
    return ChatCompletion(id="chatcmpl-1", created=1700000000, model="agentjet-tiny", choices=[choice])


async def chunks(*deltas: ChoiceDelta, last: AgentJetExtension | None) -> AsyncIterator[ChatCompletionChunk]:
    """A chat stream: the role, ``deltas``, then the finish with its extension (``None``: a stream that broke)."""
    frames = [ChoiceDelta(role="assistant", content=""), *deltas]
    for delta in frames:
        yield ChatCompletionChunk(id="c", created=1, model="agentjet-tiny", choices=[ChunkChoice(index=0, delta=delta)])
    if last is not None:
        choice = ChunkChoice(index=0, delta=ChoiceDelta(), finish_reason=last.finish_reason, agentjet=last)
        yield ChatCompletionChunk(id="c", created=1, model="agentjet-tiny", choices=[choice])


def events(frames: AsyncIterator[str]) -> list[tuple[str, dict[str, Any]]]:
    async def drain() -> list[str]:
        return [frame async for frame in frames]

    out = []
    for frame in asyncio.run(drain()):
        kind, data = frame.removesuffix("\n\n").split("\n")
        out.append((kind.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


THINK_THEN_ANSWER_THEN_CALL = (
    ChoiceDelta(reasoning="Let"),
    ChoiceDelta(reasoning=" me add."),
    ChoiceDelta(content="It"),
    ChoiceDelta(content=" is 5."),
    ChoiceDelta(tool_calls=[ToolCallDelta(index=0, id="call_1", function={"name": "add", "arguments": '{"x": 2}'})]),
)


def without_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in item.items() if k != "id"} for item in items]


# --- Responses ---------------------------------------------------------------------------------------------


def test_a_whole_answer_is_a_response_that_echoes_the_request_with_usage_and_the_extension():
    body = {"instructions": "Be brief.", "max_output_tokens": 6, "temperature": 0.5, "metadata": {"k": "v"}}
    response = response_object(completion("It is 5."), body)
    assert response["id"].startswith("resp_") and response["object"] == "response"
    assert (response["status"], response["incomplete_details"], response["error"]) == ("completed", None, None)
    assert (response["created_at"], response["model"]) == (1700000000, "agentjet-tiny")
    assert (response["instructions"], response["max_output_tokens"], response["metadata"]) == (
        "Be brief.",
        6,
        {"k": "v"},
    )
    assert (response["temperature"], response["top_p"], response["tool_choice"]) == (0.5, 1.0, "auto")
    [message] = response["output"]
    assert message["type"] == "message" and message["role"] == "assistant" and message["status"] == "completed"
    assert message["content"] == [{"type": "output_text", "text": "It is 5.", "annotations": [], "logprobs": []}]
    assert response["usage"] == {
        "input_tokens": 3,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 5,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 8,
    }
    assert response["agentjet"] == ext().model_dump(exclude_none=True)


def test_reasoning_text_and_calls_become_items_in_that_order():
    response = response_object(completion("It is 5.", reasoning="Let me add.", calls=CALLS, finish="tool_calls"), {})
    kinds = [item["type"] for item in response["output"]]
    assert kinds == ["reasoning", "message", "function_call", "function_call"]
    assert response["output"][0]["content"] == [{"type": "reasoning_text", "text": "Let me add."}]
    assert [(c["call_id"], c["name"], c["arguments"]) for c in response["output"][2:]] == [
        ("call_1", "add", '{"x": 2}'),
        ("call_2", "now", ""),
    ]
    calls_only = response_object(completion(None, calls=CALLS[:1], finish="tool_calls"), {})
    assert [item["type"] for item in calls_only["output"]] == ["function_call"]  # no empty message beside a call
    empty = response_object(completion(None), {})
    assert [item["content"][0]["text"] for item in empty["output"]] == [""]  # an empty answer is one message
    cut = response_object(completion("It is", finish="length"), {})
    assert cut["status"] == "incomplete" and cut["incomplete_details"] == {"reason": "max_output_tokens"}


def test_a_streamed_answer_is_numbered_events_that_build_the_whole_response():
    body = {"max_output_tokens": 30}
    stream = events(response_events(chunks(*THINK_THEN_ANSWER_THEN_CALL, last=ext("tool_calls")), body))
    kinds = [kind for kind, _ in stream]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",  # the reasoning item, at 0
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.output_item.done",
        "response.output_item.added",  # the message, at 1
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",  # the call, at 2, whole
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [data["type"] for _, data in stream] == kinds
    assert [data["sequence_number"] for _, data in stream] == list(range(len(stream)))
    indexes = [data["output_index"] for _, data in stream if "output_index" in data]
    assert indexes == [0] * 5 + [1] * 7 + [2] * 4
    assert stream[0][1]["response"]["status"] == "in_progress" and stream[0][1]["response"]["output"] == []
    assert "".join(d["delta"] for k, d in stream if k == "response.reasoning_text.delta") == "Let me add."
    assert "".join(d["delta"] for k, d in stream if k == "response.output_text.delta") == "It is 5."
    final = stream[-1][1]["response"]
    whole = response_object(completion("It is 5.", reasoning="Let me add.", calls=CALLS[:1], finish="tool_calls"), body)
    assert without_ids(final["output"]) == without_ids(whole["output"])
    assert (
        final["usage"] == whole["usage"] and final["agentjet"] == whole["agentjet"] and final["status"] == "completed"
    )


def test_a_stream_that_ends_without_its_extension_never_completes():
    stream = events(response_events(chunks(ChoiceDelta(content="It"), last=None), {}))
    assert "response.completed" not in [kind for kind, _ in stream]  # the route reports the failure
    assert stream[-1][0] == "response.output_item.done"


def test_a_bad_request_is_raised_before_any_event():
    async def refused() -> AsyncIterator[ChatCompletionChunk]:
        raise InvalidRequestError("max_tokens is too large")
        yield  # pragma: no cover

    for make in (lambda: response_events(refused(), {}), lambda: message_events(refused(), {}, decode)):
        with pytest.raises(InvalidRequestError, match="too large"):
            asyncio.run(anext(make()))


def test_a_stream_that_fails_after_it_began_ends_with_an_error_event_of_each_apis_shape():
    assert response_error_event("engine stopped", "engine_error") == (
        'event: error\ndata: {"type":"error","code":"engine_error","message":"engine stopped","param":null,'
        '"sequence_number":0}\n\n'
    )
    for error_type, kind in [("invalid_request_error", "invalid_request_error"), ("engine_error", "api_error")]:
        frame = message_error_event("it broke", error_type)
        assert frame.startswith("event: error\ndata: ")
        assert json.loads(frame.split("data: ")[1]) == {"type": "error", "error": {"type": kind, "message": "it broke"}}


# --- Messages ----------------------------------------------------------------------------------------------


def test_a_whole_answer_is_a_message_of_content_blocks():
    message = message_object(
        completion("It is 5.", reasoning="Let me add.", calls=CALLS, finish="tool_calls"), {}, decode
    )
    assert message["id"].startswith("msg_") and (message["type"], message["role"]) == ("message", "assistant")
    assert message["content"] == [
        {"type": "thinking", "thinking": "Let me add.", "signature": ""},
        {"type": "text", "text": "It is 5."},
        {"type": "tool_use", "id": "call_1", "name": "add", "input": {"x": 2}},
        {"type": "tool_use", "id": "call_2", "name": "now", "input": {}},  # no arguments: an empty input
    ]
    assert (message["stop_reason"], message["stop_sequence"]) == ("tool_use", None)
    assert message["usage"] == {
        "input_tokens": 3,
        "output_tokens": 5,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }
    assert message["agentjet"] == ext("tool_calls").model_dump(exclude_none=True)
    assert message_object(completion("It is", finish="length"), {}, decode)["stop_reason"] == "max_tokens"
    plain = message_object(completion("It is 5."), {}, decode)
    assert plain["stop_reason"] == "end_turn" and plain["content"] == [{"type": "text", "text": "It is 5."}]
    assert message_object(completion(None), {}, decode)["content"] == [{"type": "text", "text": ""}]


def test_the_stop_sequence_that_ended_the_answer_is_named():
    stopped = ext("stop", completion=(10, 11, 15, 14, 15))  # "It is" then "xxENDxx": cut at the first stop string
    body = {"stop_sequences": ["END", "xx"]}
    assert matched_stop(stopped, "It is", body, decode) == "xx"  # the earliest in the text, not the first listed
    assert matched_stop(stopped, "It is", {"stop_sequences": ["END"]}, decode) == "END"
    assert matched_stop(stopped, "It is", {"stop_sequences": ["zz"]}, decode) is None
    assert matched_stop(ext("length", completion=(10, 15)), "It", body, decode) is None  # cut by max_tokens instead
    assert matched_stop(stopped, "It is", {}, decode) is None
    choice = Choice(index=0, message=AssistantMessage(content="It is"), finish_reason="stop", agentjet=stopped)
    message = message_object(ChatCompletion(id="c", created=1, model="m", choices=[choice]), body, decode)
    assert (message["stop_reason"], message["stop_sequence"]) == ("stop_sequence", "xx")


def test_a_streamed_answer_is_a_message_of_indexed_block_events():
    stream = events(message_events(chunks(*THINK_THEN_ANSWER_THEN_CALL, last=ext("tool_calls")), {}, decode))
    shape = [(kind, data.get("index"), (data.get("delta") or {}).get("type")) for kind, data in stream]
    assert shape == [
        ("message_start", None, None),
        ("content_block_start", 0, None),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "signature_delta"),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, None),
        ("content_block_delta", 1, "text_delta"),
        ("content_block_delta", 1, "text_delta"),
        ("content_block_stop", 1, None),
        ("content_block_start", 2, None),
        ("content_block_delta", 2, "input_json_delta"),
        ("content_block_stop", 2, None),
        ("message_delta", None, None),
        ("message_stop", None, None),
    ]
    assert [data["type"] for _, data in stream] == [kind for kind, _ in stream]
    start = stream[0][1]["message"]
    assert (start["role"], start["content"], start["stop_reason"], start["model"]) == (
        "assistant",
        [],
        None,
        "agentjet-tiny",
    )
    assert [d["content_block"]["type"] for k, d in stream if k == "content_block_start"] == [
        "thinking",
        "text",
        "tool_use",
    ]
    assert stream[11][1]["delta"]["partial_json"] == '{"x": 2}'
    delta = stream[-2][1]
    assert delta["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 5 and delta["agentjet"] == ext("tool_calls").model_dump(exclude_none=True)


def test_an_empty_streamed_answer_is_one_empty_text_block():
    stream = events(message_events(chunks(last=ext("stop", completion=(100,))), {}, decode))
    assert [(k, d.get("index")) for k, d in stream][1:3] == [("content_block_start", 0), ("content_block_stop", 0)]
    assert stream[1][1]["content_block"] == {"type": "text", "text": ""}
    assert stream[-2][1]["delta"]["stop_reason"] == "end_turn"


# --- the events a real server streams ---------------------------------------------------------------------


def test_responses_stream_events(live_server):
    body = {"model": "agentjet-tiny", "input": "Tell me a story", "max_output_tokens": 8, "stream": True, "seed": 2}
    with httpx2.stream("POST", live_server.url + "/v1/responses", json=body) as response:
        assert response.status_code == 200
        events = sse_events(response)
    kinds = [kind for kind, _ in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"  # with status incomplete when cut at max_output_tokens
    assert [data["type"] for _, data in events] == kinds
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    text = "".join(data["delta"] for kind, data in events if kind == "response.output_text.delta")
    final = events[-1][1]["response"]
    assert final["output"][0]["content"][0]["text"] == text
    whole = httpx2.post(live_server.url + "/v1/responses", json={**body, "stream": False}).json()
    assert whole["agentjet"]["completion_token_ids"] == final["agentjet"]["completion_token_ids"]


def test_messages_stream_events_and_stop_sequences(chatty_server):
    url = chatty_server.url + "/v1/messages"
    body = {
        "model": "agentjet-tiny",
        "max_tokens": 12,
        "messages": [{"role": "user", "content": "Tell me a story"}],
        "seed": 4,
    }
    whole = httpx2.post(url, json=body).json()
    assert whole["stop_reason"] == "max_tokens" and whole["type"] == "message"
    text = whole["content"][0]["text"]
    with httpx2.stream("POST", url, json={**body, "stream": True}) as response:
        events = sse_events(response)
    kinds = [kind for kind, _ in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    deltas = "".join(d["delta"]["text"] for k, d in events if k == "content_block_delta")
    assert (
        deltas == text
        and events[-2][1]["agentjet"]["completion_token_ids"] == whole["agentjet"]["completion_token_ids"]
    )
    stop = text.strip()[len(text.strip()) // 2 :][:3]  # a piece from the middle of what it says
    cut = httpx2.post(url, json={**body, "stop_sequences": [stop]}).json()
    assert cut["stop_reason"] == "stop_sequence" and cut["stop_sequence"] == stop, (text, cut)
    assert stop not in cut["content"][0]["text"]
