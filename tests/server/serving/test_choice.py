"""One choice as it is sampled (``ChoiceState``): incremental detokenisation and stop strings, on the real
tokenizer."""

from __future__ import annotations

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
