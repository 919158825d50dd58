"""Reading a model's answer (``serving.parsing``): without parser flags the built-in Hermes parser reads tool
calls and nothing is reasoning; parser names this server cannot honour are refused before a model loads,
saying how to fix it; and a model family's reader decides what the agent is shown (reasoning, content), whole
and streamed, while every sampled token stays in the turn. The family here is one written in the test
against the ``OutputParser`` interface (vLLM's own parsers are checked in ``tests/vllm``)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from agentjet_client.protocol import ChatCompletionRequest
from agentjet_server.engine.base import EngineOptions
from agentjet_server.engine.hf import TransformersEngine
from agentjet_server.errors import ModelLoadError
from agentjet_server.serving import ChatService, PromptBuilder, Sampler
from agentjet_server.serving.parsing import (
    VLLM_MISSING,
    ChoiceReader,
    Delta,
    OutputParser,
    Parsed,
    check_parser_names,
    load_parser,
)

ASK = [{"role": "user", "content": "Tell me a story"}]


@pytest.fixture
def without_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on a server where vLLM is not installed (``import vllm`` fails), whatever this environment holds."""
    monkeypatch.setitem(sys.modules, "vllm", None)


def test_the_builtin_parser_reads_hermes_tool_calls_and_no_reasoning():
    parser = OutputParser()
    assert (
        parser.builtin and not parser.reasoning and parser.describe() == "tool calls: built-in hermes; reasoning: none"
    )
    assert parser.reader(ASK, None, None, [1, 2]) is None  # serving reads built-in answers itself
    answer = parser.answer('ok <tool_call>{"name": "add", "arguments": {"x": 1}}</tool_call>', [5, 6])
    assert answer.reasoning is None and answer.content == "ok"
    [call] = answer.tool_calls
    assert (call.function.name, call.function.arguments) == ("add", '{"x": 1}') and call.id.startswith("call_")
    thinking = parser.answer("<think>hm</think> 5", [7])
    assert thinking == Parsed(None, "<think>hm</think> 5", [])  # no reasoning parser: it is all content


def test_without_flags_the_server_reads_answers_itself(model_dir):
    parser = load_parser(model_dir, None, None)
    assert type(parser) is OutputParser and parser.builtin
    check_parser_names(None, None)
    check_parser_names("hermes", None)


def test_hermes_needs_no_vllm_and_other_parsers_say_how_to_get_it(model_dir, without_vllm):
    assert load_parser(model_dir, "hermes", None).builtin  # the built-in Hermes parser needs no vLLM
    with pytest.raises(ModelLoadError) as caught:
        check_parser_names("llama3_json", "qwen3")
    message = str(caught.value)
    assert message.startswith("--tool-call-parser llama3_json and --reasoning-parser qwen3 needs vLLM's parsers")
    assert VLLM_MISSING in message and message.endswith("only the built-in --tool-call-parser hermes is available")
    with pytest.raises(ModelLoadError, match=r"^--reasoning-parser qwen3 needs vLLM's parsers"):
        load_parser(model_dir, None, "qwen3")  # a reasoning parser always comes from vLLM


class FirstWord(ChoiceReader):
    """A family whose answers think until their first space: that much is reasoning, the rest content."""

    def __init__(self) -> None:
        self.text = ""
        self.ids: list[int] = []

    def whole(self, text: str, token_ids: Sequence[int]) -> Parsed:
        cut = text.find(" ") if " " in text else len(text)
        return Parsed(text[:cut] or None, text[cut:] or None, [])

    def step(self, delta_text: str, delta_ids: Sequence[int], finished: bool) -> Delta:
        self.ids += delta_ids
        before, self.text = len(self.text), self.text + delta_text
        cut = max(before, self.text.find(" ") if " " in self.text else len(self.text))
        return Delta(reasoning=self.text[before:cut], content=self.text[cut:])


class FirstWordFamily(OutputParser):
    builtin = False
    reasoning = True
    tool_name = "first-word"

    def __init__(self) -> None:
        self.asked: list[tuple[Any, ...]] = []
        self.readers: list[FirstWord] = []

    def reader(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        tool_choice: Any,
        prompt_ids: Sequence[int],
    ) -> ChoiceReader:
        self.asked.append((list(messages), tools, tool_choice, list(prompt_ids)))
        self.readers.append(FirstWord())
        return self.readers[-1]


@pytest.fixture(scope="module")
def chatty(chatty_model_dir: Path) -> Iterator[TransformersEngine]:
    engine = TransformersEngine(chatty_model_dir, EngineOptions(model_name="agentjet-tiny"))  # rambles until max_tokens
    yield engine
    engine.close()


def test_a_familys_reader_decides_what_the_agent_is_shown_and_every_token_stays_in_the_turn(chatty):
    family = FirstWordFamily()
    chat = ChatService(PromptBuilder(chatty, parser=family), Sampler(chatty))
    request = ChatCompletionRequest.model_validate({"messages": ASK, "max_tokens": 16, "seed": 3})
    reply = asyncio.run(chat.complete(request, "agentjet-tiny"))
    [choice] = reply.choices
    ext = choice.agentjet
    assert ext is not None and ext.finish_reason == "length"
    text = chatty.decode(ext.completion_token_ids)
    assert " " in text.strip()  # the answer has both parts (the first space is not at the very end)
    cut = text.find(" ")
    assert choice.message.reasoning == choice.message.reasoning_content == text[:cut]
    assert choice.message.content == text[cut:]  # shown apart; the turn keeps all the sampled tokens
    [(messages, tools, tool_choice, prompt_ids)] = family.asked  # one fresh reader per choice, told the request
    assert messages == ASK and tools is None and tool_choice is None and prompt_ids == ext.prompt_token_ids

    async def chunks() -> list[Any]:
        return [c async for c in chat.stream_chunks(request.model_copy(update={"stream": True}), "agentjet-tiny")]

    streamed = [c.choices[0] for c in asyncio.run(chunks())]
    assert "".join(c.delta.reasoning or "" for c in streamed) == choice.message.reasoning
    assert "".join(c.delta.content or "" for c in streamed) == choice.message.content
    assert family.readers[-1].ids == ext.completion_token_ids  # the reader saw every token as it came
    assert streamed[-1].agentjet is not None and streamed[-1].agentjet.completion_token_ids == ext.completion_token_ids
