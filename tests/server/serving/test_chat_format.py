"""Tool calls in the built-in format: forced by a named tool_choice, chosen by the warmed-up model, text that
is no valid call kept as content, calls sent back in the history, and the parser itself."""

from __future__ import annotations

import json

import pytest

from tests.conftest import TOOLS

ASK = [{"role": "user", "content": "What is 2 + 3?"}]


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
