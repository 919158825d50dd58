"""Chat formatting: the ChatML template with tools, and parsing tool calls out of model output.

The template is the one the embedded model is built with. It follows the widely used ChatML
convention for tools: tool schemas go into the system turn inside ``<tools>`` tags, the model
answers a call as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` and tool results
come back as ``tool`` turns.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from agentjet_client.protocol import FunctionCall, ToolCall

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

CHATML_TOOLS_TEMPLATE = (
    "{% set ns = namespace(system='') %}"
    "{% if messages and messages[0]['role'] in ['system', 'developer'] %}"
    "{% set ns.system = messages[0]['content'] %}"
    "{% endif %}"
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if ns.system %}{{ ns.system }}\n\n{% endif %}"
    "You can call functions. Their signatures are listed inside <tools></tools>:\n<tools>\n"
    "{% for tool in tools %}{{ (tool.function if tool.function is defined else tool) | tojson }}\n{% endfor %}"
    '</tools>\nTo call a function, answer with <tool_call>{"name": NAME, "arguments": ARGS}</tool_call>'
    "<|im_end|>\n"
    "{% elif ns.system %}"
    "<|im_start|>system\n{{ ns.system }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] in ['system', 'developer'] %}"
    "{% elif message['role'] == 'assistant' %}"
    "<|im_start|>assistant\n{% if message['content'] %}{{ message['content'] }}{% endif %}"
    "{% for call in message.get('tool_calls') or [] %}"
    "<tool_call>{\"name\": {{ call['function']['name'] | tojson }}, \"arguments\": "
    "{{ call['function']['arguments'] }}}</tool_call>"
    "{% endfor %}"
    "<|im_end|>\n"
    "{% else %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None
    tool_calls: list[ToolCall]


_CALL_RE = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)(?:" + re.escape(TOOL_CALL_CLOSE) + r"|$)", re.S)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    if len({key for key, _ in pairs}) != len(pairs):
        raise ValueError(f"a key appears twice in {pairs!r}")
    return dict(pairs)


def parse_tool_calls(text: str) -> ParsedOutput:
    """Split model output into plain content and tool calls.

    A block that is not a JSON object with a string ``name`` and object ``arguments`` (or a string
    holding one) leaves the whole output as plain content: a malformed call is the model's mistake
    and must reach the agent unchanged. So does an object with a key twice (``{"b": 3, "b": 2}``):
    any JSON reader keeps one of them, so the call the agent sends back would differ from the
    sampled one. Calls whose arguments are not an object would be rewritten
    by the agent's framework (LangChain makes them invalid calls, AgentScope empty ones), so the
    history it sends back would no longer be what was sampled.
    """
    if TOOL_CALL_OPEN not in text:
        return ParsedOutput(content=text, tool_calls=[])
    calls: list[ToolCall] = []
    for match in _CALL_RE.finditer(text):
        try:
            payload = json.loads(match.group(1).strip(), object_pairs_hook=_unique_keys)
        except ValueError:  # not JSON, or a key given twice
            return ParsedOutput(content=text, tool_calls=[])
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
            return ParsedOutput(content=text, tool_calls=[])
        arguments = payload.get("arguments", {})
        if isinstance(arguments, str):
            try:
                decoded = json.loads(arguments, object_pairs_hook=_unique_keys)
            except ValueError:
                return ParsedOutput(content=text, tool_calls=[])
            if not isinstance(decoded, dict):
                return ParsedOutput(content=text, tool_calls=[])
        elif isinstance(arguments, dict):
            arguments = json.dumps(arguments)
        else:
            return ParsedOutput(content=text, tool_calls=[])
        calls.append(
            ToolCall(
                id=f"call_{uuid.uuid4().hex[:24]}",
                function=FunctionCall(name=payload["name"], arguments=arguments),
            )
        )
    content = without_tool_calls(text).strip()
    return ParsedOutput(content=content or None, tool_calls=calls)


def without_tool_calls(text: str) -> str:
    """``text`` with its ``<tool_call>`` blocks cut out (what ``parse_tool_calls`` keeps as content)."""
    return _CALL_RE.sub("", text)


def forced_tool_prefix(tool_choice: object) -> str:
    """Text to place at the start of the assistant turn to honour ``tool_choice``.

    ``required`` opens a call; a named choice also writes the function's name. The forced text
    belongs to the prompt (it was not sampled), so it is never trained as policy output.
    """
    if tool_choice == "required":
        return TOOL_CALL_OPEN
    name = getattr(getattr(tool_choice, "function", None), "name", None)
    if name is not None:
        # no trailing space: the text must end on a pre-token boundary, else the forced tokens
        # differ from how a whole call tokenizes and the model continues from an unseen split
        return TOOL_CALL_OPEN + '{"name": ' + json.dumps(name) + ', "arguments":'
    return ""
