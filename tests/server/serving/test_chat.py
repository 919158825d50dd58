"""Chat completions streamed: the content around tool calls adds up to the whole answer's."""

from __future__ import annotations

import pytest

from agentjet_server.engine.base import SamplingParams, TokenEvent
from agentjet_server.engine.hf import TransformersEngine
from agentjet_server.serving import ChoiceState, PreparedRequest


@pytest.fixture(scope="module")
def engine(model_dir):
    e = TransformersEngine(model_dir)
    yield e
    e.close()


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
