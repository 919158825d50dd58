"""The chat completion route and /v1/models, served by a real uvicorn on 127.0.0.1 and driven by the real
OpenAI SDK: exact token ids and log-probs, streams token by token, refusals with a reason, and generations
that stop when their caller hangs up (text completions: ``serving/test_text.py``)."""

from __future__ import annotations

import json

import httpx2
import pytest

from tests.conftest import LiveServer
from tests.server.api.calls import ASK, post


def test_models_and_health(live_server, sdk):
    assert [m.id for m in sdk.models.list().data] == ["agentjet-tiny"]
    health = httpx2.get(live_server.url + "/healthz").json()
    assert health["status"] == "ok"


def test_non_streaming_answer_with_logprobs_and_exact_token_ids(live_server, sdk):
    reply = sdk.chat.completions.create(
        model="agentjet-tiny", messages=ASK, max_tokens=6, logprobs=True, top_logprobs=2, seed=1
    )
    choice = reply.choices[0]
    ext = choice.model_extra["agentjet"]
    engine = live_server.engine
    text_ids = [t for t in ext["completion_token_ids"] if not engine.is_stop_token(t)]
    assert engine.decode(text_ids) == choice.message.content
    assert ext["prompt_token_ids"] == engine.render(ASK)
    assert len(ext["completion_logprobs"]) == len(ext["completion_token_ids"]) == len(ext["completion_versions"])
    # one entry per sampled token, the end token too (as vLLM's server lists them): usage counts the same
    assert [lp.logprob for lp in choice.logprobs.content] == pytest.approx(ext["completion_logprobs"])
    assert len(choice.logprobs.content) == reply.usage.completion_tokens == len(ext["completion_token_ids"])
    if reply.choices[0].finish_reason == "stop":
        assert choice.logprobs.content[-1].token == "<|im_end|>"
    assert all(len(lp.top_logprobs) == 2 for lp in choice.logprobs.content)
    assert reply.usage.prompt_tokens == len(ext["prompt_token_ids"])
    assert ext["policy_version"] == live_server.runtime.version


def test_seed_makes_sampling_reproducible_and_n_gives_several_choices(sdk):
    a = sdk.chat.completions.create(model="agentjet-tiny", messages=ASK, max_tokens=8, seed=42, n=3)
    b = sdk.chat.completions.create(model="agentjet-tiny", messages=ASK, max_tokens=8, seed=42, n=3)
    ids = lambda r: [c.model_extra["agentjet"]["completion_token_ids"] for c in r.choices]  # noqa: E731
    assert len(a.choices) == 3 and ids(a) == ids(b)


def test_streaming_is_token_by_token_and_matches_extension(chatty_server, chatty_sdk):
    live_server = chatty_server
    sdk = chatty_sdk
    stream = sdk.chat.completions.create(
        model="agentjet-tiny",
        messages=[{"role": "user", "content": "Tell me a story"}],
        max_tokens=12,
        stream=True,
        seed=3,
        stream_options={"include_usage": True},
        logprobs=True,
    )
    deltas, ext, usage, entries = [], None, None, 0
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            entries += len(choice.logprobs.content or []) if choice.logprobs else 0
            if choice.delta.content:
                deltas.append(choice.delta.content)
            if choice.finish_reason:
                ext = choice.model_extra["agentjet"]
    assert ext is not None and usage is not None
    text_ids = [t for t in ext["completion_token_ids"] if not live_server.engine.is_stop_token(t)]
    assert "".join(deltas) == live_server.engine.decode(text_ids)
    assert len(deltas) >= 4  # several chunks, not one buffered body
    assert usage.completion_tokens == len(ext["completion_token_ids"]) == entries


def test_stream_and_non_stream_agree_for_same_seed(chatty_sdk):
    sdk = chatty_sdk
    kw = dict(model="agentjet-tiny", messages=ASK, max_tokens=10, seed=9)
    whole = sdk.chat.completions.create(**kw).choices[0].model_extra["agentjet"]["completion_token_ids"]
    streamed = None
    for chunk in sdk.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            if choice.finish_reason:
                streamed = choice.model_extra["agentjet"]["completion_token_ids"]
    assert streamed == whole


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_cut_the_text(chatty_sdk, stream):
    sdk = chatty_sdk
    kw = dict(
        model="agentjet-tiny", messages=[{"role": "user", "content": "Say something long"}], max_tokens=40, seed=5
    )
    free = sdk.chat.completions.create(**kw).choices[0].message.content
    stop = free[len(free) // 2 : len(free) // 2 + 2]
    assert len(stop) == 2
    if stream:
        text = "".join(
            c.choices[0].delta.content or ""
            for c in sdk.chat.completions.create(stream=True, stop=[stop], **kw)
            if c.choices
        )
    else:
        reply = sdk.chat.completions.create(stop=[stop], **kw)
        assert reply.choices[0].finish_reason == "stop"
        text = reply.choices[0].message.content
    assert text == free[: free.find(stop)]


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b"", "empty"),
        (
            json.dumps({"messages": [{"role": "user", "content": "hi"}], "temprature": 0.5}).encode(),
            "temprature: unknown field",
        ),
        (json.dumps({"messages": [{"role": "robot", "content": "hi"}]}).encode(), "messages.0.role"),
        (json.dumps({"messages": "hello"}).encode(), "messages"),
        (json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}).encode(), "max_tokens"),
        (json.dumps({"messages": [{"role": "user", "content": "hi"}], "temperature": 9}).encode(), "temperature"),
        (json.dumps({"messages": []}).encode(), "messages"),
        (json.dumps({"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}).encode(), "not served here"),
    ],
)
def test_bad_chat_requests_get_4xx_with_a_reason(live_server, body, needle):
    r = post(live_server, "/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"] == "invalid_request_error"


def test_bad_stream_request_is_4xx_not_a_broken_stream(live_server):
    r = post(
        live_server,
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "x" * 20000}], "stream": True},
    )
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]


def test_streaming_n_interleaves_choices_each_with_its_extension(chatty_sdk):
    texts: dict[int, str] = {0: "", 1: ""}
    exts: dict[int, dict] = {}
    kw = dict(model="agentjet-tiny", messages=ASK, max_tokens=10, seed=4, n=2)
    for chunk in chatty_sdk.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                exts[choice.index] = choice.model_extra["agentjet"]
    whole = chatty_sdk.chat.completions.create(**kw)
    assert set(exts) == {0, 1}
    for choice in whole.choices:
        assert exts[choice.index]["completion_token_ids"] == choice.model_extra["agentjet"]["completion_token_ids"]
        assert texts[choice.index] == choice.message.content


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


def test_a_stream_that_fails_after_its_first_frame_ends_with_an_error_event_and_done(model_dir):
    """The 200 is already sent when sampling fails: the client must learn of it from the stream."""
    import json

    import httpx2

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
