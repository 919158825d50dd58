"""The OpenAI-compatible API, served by a real uvicorn on 127.0.0.1, driven by the real OpenAI SDK."""

import json

import httpx2
import openai
import pytest

from agentjet_client.protocol import Trajectory, Turn
from tests.conftest import TOOLS

ASK = [{"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture(scope="module")
def sdk(live_server):
    with openai.OpenAI(base_url=live_server.url + "/v1", api_key="unused") as client:
        yield client


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


@pytest.fixture(scope="module")
def chatty_sdk(chatty_server):
    with openai.OpenAI(base_url=chatty_server.url + "/v1", api_key="unused") as client:
        yield client


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
def test_named_tool_choice_yields_parsed_tool_call(sdk, stream):
    """A forced tool call is parsed into ``tool_calls``; output the tiny model garbles stays as text.

    The embedded model writes valid JSON arguments only some of the time (its build is not
    bit-identical across machines), so 24 samples are drawn and each is checked for what the
    server must do with it.
    """
    kw = dict(
        model="agentjet-tiny",
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "add"}},
        max_tokens=30,
        n=24,
        seed=3,
    )
    if not stream:
        choices = [
            (c.finish_reason, c.message.content, c.message.tool_calls)
            for c in sdk.chat.completions.create(**kw).choices
        ]
    else:
        parts: dict[int, list] = {}
        for chunk in sdk.chat.completions.create(stream=True, **kw):
            for c in chunk.choices:
                got = parts.setdefault(c.index, [None, "", []])
                got[0] = c.finish_reason or got[0]
                got[1] += c.delta.content or ""
                got[2].extend(c.delta.tool_calls or [])
        choices = [(f, text or None, calls or None) for f, text, calls in parts.values()]
    assert len(choices) == 24
    parsed = 0
    for finish, content, calls in choices:
        if finish == "tool_calls":
            parsed += 1
            assert content is None and [c.function.name for c in calls] == ["add"]
            assert isinstance(json.loads(calls[0].function.arguments), dict)
            assert all(c.id.startswith("call_") for c in calls if c.id)
        else:  # not parseable: returned as text, nothing dropped
            assert finish in ("stop", "length") and calls is None
            assert content.startswith("<tool_call>")
    assert parsed >= 1


def test_auto_tool_choice_lets_the_warmed_model_call_a_tool(sdk):
    reply = sdk.chat.completions.create(
        model="agentjet-tiny", messages=ASK, tools=TOOLS, max_tokens=30, temperature=0.0
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    json.loads(choice.message.tool_calls[0].function.arguments)  # the tiny model may pick any tool; the call parses


def test_invalid_tool_call_text_comes_back_as_content(chatty_sdk):
    """The random model can't write JSON: a forced call that doesn't parse is returned, not dropped."""
    sdk = chatty_sdk
    reply = sdk.chat.completions.create(
        model="agentjet-tiny", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=8, seed=1
    )
    choice = reply.choices[0]
    assert choice.message.tool_calls is None and choice.message.content.startswith("<tool_call>")


def test_tool_calls_round_trip_through_history(sdk, live_server):
    """A conversation with assistant tool_calls and a tool result renders and is served."""
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"x": 2}'}}
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    ]
    reply = sdk.chat.completions.create(model="agentjet-tiny", messages=history, tools=TOOLS, max_tokens=4)
    prompt = live_server.engine.decode(reply.choices[0].model_extra["agentjet"]["prompt_token_ids"])
    assert '<tool_call>{"name": "add", "arguments": {"x": 2}}</tool_call>' in prompt and "<tools>" in prompt


def test_tool_call_parser():
    from agentjet_server.serving.chat_format import parse_tool_calls

    out = parse_tool_calls('ok <tool_call>{"name": "add", "arguments": {"x": 1}}</tool_call>')
    assert out.content == "ok" and out.tool_calls[0].function.name == "add"
    assert json.loads(out.tool_calls[0].function.arguments) == {"x": 1}
    for text in (
        "<tool_call>{not json</tool_call>",
        '<tool_call>{"name": "square", "arguments": 6}</tool_call>',  # arguments must be an object
        '<tool_call>{"name": "add", "arguments": "[1, 2]"}</tool_call>',
        '<tool_call>{"name": "add", "arguments": "{oops"}</tool_call>',
        # a key twice: a reader keeps one, so the call sent back would not be the sampled one
        '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 3, "b": 2}}</tool_call>',
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"a\\": 2}"}</tool_call>',
        '<tool_call>{"name": "add", "name": "sub", "arguments": {}}</tool_call>',
    ):
        broken = parse_tool_calls(text)
        assert broken.tool_calls == [] and broken.content == text
    as_string = parse_tool_calls('<tool_call>{"name": "add", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert json.loads(as_string.tool_calls[0].function.arguments) == {"x": 1}
    assert parse_tool_calls('<tool_call>{"name": "now"}</tool_call>').tool_calls[0].function.arguments == "{}"


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


# ----------------------------------------------------------------------------------- bad input


def post(live_server, path, **kw):
    return httpx2.post(live_server.url + path, timeout=30, **kw)


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


def test_oversized_body_is_413(live_server):
    big = {"messages": [{"role": "user", "content": "x" * (live_server.settings.max_body_bytes + 10)}]}
    r = post(live_server, "/v1/chat/completions", json=big)
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]


def test_unknown_route_and_method_are_openai_shaped(live_server):
    r = httpx2.get(live_server.url + "/v1/nope")
    assert r.status_code == 404 and "no route" in r.json()["error"]["message"]
    r = httpx2.get(live_server.url + "/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()


# ----------------------------------------------------------------------------------- trajectories


def real_turn(live_server, sdk, version_offset=0):
    reply = sdk.chat.completions.create(model="agentjet-tiny", messages=ASK, max_tokens=4)
    ext = reply.choices[0].model_extra["agentjet"]
    return Turn(
        policy_version=ext["policy_version"] - version_offset,
        prompt_token_ids=ext["prompt_token_ids"],
        completion_token_ids=ext["completion_token_ids"],
        completion_logprobs=ext["completion_logprobs"],
        finish_reason=ext["finish_reason"],
    )


def test_trajectory_results_accept_duplicate_stale_invalid(live_server, sdk):
    rt = live_server.runtime
    version, step = rt.loop.live
    rt.loop.live = (version + 10, step)  # pretend the learner has moved on 10 versions
    try:
        fresh_turn = real_turn(live_server, sdk).model_copy(update={"policy_version": rt.version - 2})
        fresh = Trajectory(id="t-fresh", task_id="g-fresh", turns=[fresh_turn], reward=1.0)
        stale_turn = real_turn(live_server, sdk).model_copy(update={"policy_version": rt.version - 3})
        stale = Trajectory(id="t-stale", task_id="g-stale", turns=[stale_turn], reward=1.0)
        bad_turn = real_turn(live_server, sdk)
        bad_turn = bad_turn.model_copy(
            update={"completion_token_ids": [10**6] * len(bad_turn.completion_token_ids), "policy_version": rt.version}
        )
        bad_tokens = Trajectory(id="t-bad", task_id="g-bad", turns=[bad_turn], reward=0.0)
        body = {"trajectories": [t.model_dump(mode="json") for t in (fresh, stale, bad_tokens)]}
        res = post(live_server, "/v1/trajectories", json=body).json()["results"]
        assert [r["status"] for r in res] == ["accepted", "rejected", "rejected"]
        assert "stale" in res[1]["reason"] and "max_staleness is 2" in res[1]["reason"]
        assert "vocabulary" in res[2]["reason"]
        again = post(live_server, "/v1/trajectories", json={"trajectories": [fresh.model_dump(mode="json")]}).json()[
            "results"
        ]
        assert again[0]["status"] == "duplicate"
        counts = httpx2.get(live_server.url + "/v1/status").json()["trajectories"]
        assert counts["rejected_by_reason"]["stale"] >= 1 and counts["duplicate"] >= 1
    finally:
        rt.loop.live = (version, step)


def test_duplicate_inside_one_batch_is_trained_once(live_server, sdk):
    t = Trajectory(id="t-twice", task_id="g-twice", turns=[real_turn(live_server, sdk)], reward=1.0)
    body = {"trajectories": [t.model_dump(mode="json")]}
    before = live_server.runtime.buffer.buffered
    res = post(live_server, "/v1/trajectories", json={"trajectories": body["trajectories"] * 2}).json()["results"]
    assert [r["status"] for r in res] == ["accepted", "duplicate"]
    assert post(live_server, "/v1/trajectories", json=body).json()["results"][0]["status"] == "duplicate"
    assert live_server.runtime.buffer.buffered == before + 1  # buffered for training once


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (
            {"trajectories": [{"id": "x", "task_id": "t", "turns": [], "status": "failed", "extra_field": 1}]},
            "extra_field: unknown field",
        ),
        ({"trajectories": [{"id": "x", "task_id": "t", "reward": "high", "status": "failed"}]}, "reward"),
        ({"trajectories": [{"id": "x", "task_id": "t", "reward": 1.0}]}, "at least one turn"),
        ({"trajectories": []}, "trajectories"),
        ({"trajectory": []}, "trajectory: unknown field"),
    ],
)
def test_bad_trajectory_batches_get_400(live_server, body, needle):
    r = post(live_server, "/v1/trajectories", json=body)
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


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
