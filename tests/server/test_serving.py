"""Incremental detokenisation and stop strings in ``serving``, on the real tokenizer."""

import pytest

from agentjet_server.engine.base import SamplingParams, TokenEvent
from agentjet_server.engine.hf import TransformersEngine
from agentjet_server.serving import ChoiceState, PreparedRequest

TEXT = "héllo wörld 🚀 ça va? 日本語 done"


@pytest.fixture(scope="module")
def engine(model_dir):
    e = TransformersEngine(model_dir)
    yield e
    e.close()


def feed(engine, ids, stop=()):
    prepared = PreparedRequest([1], SamplingParams(max_tokens=999, stop=tuple(stop)), "", False, False)
    state = ChoiceState(engine, prepared)
    streamed = ""
    for i, tid in enumerate(ids):
        state.add(TokenEvent(tid, -0.1, 0, [], "stop" if i == len(ids) - 1 else None))
        final = i == len(ids) - 1 or state.stopped_by_string
        streamed += state.sendable(final=final)
        assert "\ufffd" not in streamed
        if state.stopped_by_string:
            break
    return state, streamed


def test_incremental_text_equals_whole_decode_for_multibyte_text(engine):
    ids = engine.tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(ids) > len(TEXT.split())  # multi-byte characters really are split over tokens
    state, streamed = feed(engine, ids)
    assert state.text == engine.decode(ids) == TEXT == streamed


def test_stop_string_across_tokens_cuts_text_and_stream(engine):
    ids = engine.tokenizer.encode(TEXT, add_special_tokens=False)
    state, streamed = feed(engine, ids, stop=["🚀 ç"])
    assert state.stopped_by_string and state.finish == "stop"
    assert state.text == streamed == "héllo wörld "


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_hangs_up_stops_its_generation(chatty_server, stream):
    """The engine drops a request whose client went away: it costs the server nothing more."""
    import json
    import socket
    import time

    import httpx2

    engine = chatty_server.engine
    ask = [{"role": "user", "content": "go on"}]
    # a seed whose completion runs long when nobody hangs up (the same seed samples the same tokens)
    for seed in range(40):
        full = httpx2.post(
            chatty_server.url + "/v1/chat/completions",
            json={"model": "agentjet-tiny", "messages": ask, "max_tokens": 1000, "seed": seed},
            timeout=60,
        ).json()["usage"]["completion_tokens"]
        if full >= 600:
            break
    assert full >= 600
    request = {"model": "agentjet-tiny", "messages": ask, "max_tokens": 1000, "seed": seed, "stream": stream}
    body = json.dumps(request).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    before = engine.tokens_sampled
    with socket.create_connection(("127.0.0.1", chatty_server.port)) as sock:
        sock.sendall(head + body)
        deadline = time.monotonic() + 10
        while engine.tokens_sampled - before < 20:  # generation is under way
            assert time.monotonic() < deadline
            time.sleep(0.005)
    deadline = time.monotonic() + 10
    while True:  # wait until sampling stops (it would run on to `full` tokens if nobody noticed)
        settled = engine.tokens_sampled
        time.sleep(0.5)
        if engine.tokens_sampled == settled or time.monotonic() > deadline:
            break
    assert settled - before < full / 2, f"sampled {settled - before} of {full} tokens after the client left"


@pytest.mark.parametrize(
    "text",
    [
        'ok <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>',
        '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>}}</tool_call>',  # sampled by the tiny model
        'I will add. <tool_call>{"name": "add", "arguments": {}}</tool_call> then <tool_call>{"name": "n"}</tool_call>',
        "no call at all, just text",
    ],
)
def test_streamed_content_around_tool_calls_equals_the_whole_answer(engine, text):
    """A client that accumulates the deltas gets the content and calls a non-streamed answer has."""
    from agentjet_server.serving.chat import final_frames

    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    prepared = PreparedRequest([1], SamplingParams(max_tokens=999), "", True, False)
    state = ChoiceState(engine, prepared)
    chunks: list = []
    streamed = ""
    for i, tid in enumerate(ids):
        state.add(TokenEvent(tid, -0.1, 0, [], "stop" if i == len(ids) - 1 else None))
        streamed += state.sendable(final=i == len(ids) - 1)
    final_frames(lambda choices: chunks.extend(choices) or "", 0, state)
    streamed += "".join(c.delta.content or "" for c in chunks)
    names = [t.function["name"] for c in chunks for t in c.delta.tool_calls or []]
    content, calls = state.parsed()
    assert streamed.strip() == (content or "")
    assert names == [call.function.name for call in calls]


def test_a_stream_that_fails_after_its_first_frame_ends_with_an_error_event_and_done(model_dir):
    """The 200 is already sent when sampling fails: the client must learn of it from the stream."""
    import json

    import httpx2

    from tests.conftest import LiveServer

    server = LiveServer(model_dir)
    try:
        server.engine.close()  # requests are still accepted, but sampling fails once they start
        body = {"messages": [{"role": "user", "content": "Say one."}], "max_tokens": 4, "stream": True}
        with httpx2.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=30) as response:
            lines = [line for line in response.iter_lines() if line.startswith("data: ")]
        assert response.status_code == 200
        assert json.loads(lines[0][6:])["choices"][0]["delta"]["role"] == "assistant"
        error = json.loads(lines[-2][6:])["error"]
        assert error["type"] == "engine_error" and "shut down" in error["message"]
        assert lines[-1] == "data: [DONE]"
    finally:
        server.stop()
