"""The other APIs agents speak, as Chat Completions: OpenAI's Responses API and Anthropic's Messages API.

The server serves ``/v1/responses`` and ``/v1/messages`` by turning each request into the chat
request it means (``responses_to_chat``, ``messages_to_chat``), sampling it as any chat request
(same template, same token-exact extension, same signature) and writing the answer back in the
API's own shape. The client's capture uses the same functions: a turn of any API records the chat
messages its request meant, and its answer as text and tool calls, so a conversation held in
Responses items or Anthropic content blocks is matched to its earlier calls, continued from their
exact tokens and merged into one timeline exactly as a chat conversation is.

Both APIs are served stateless: a request that refers to stored state (``previous_response_id``,
``conversation``, item references) is refused with a message that says to send the whole
conversation instead.
"""

from __future__ import annotations

import json
from typing import Any


class DialectError(ValueError):
    """The request cannot be turned into a chat request; ``param`` names the field at fault."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def _copy_set(body: dict[str, Any], chat: dict[str, Any], names: tuple[tuple[str, str], ...]) -> None:
    """Into ``chat``, the request's fields named ``(chat name, the API's name)`` that it sets, and the two
    that both APIs pass through as they are: ``seed`` (in neither API; taken as vLLM takes extra
    sampling parameters) and our ``agentjet`` extension."""
    for ours, theirs in (*names, ("seed", "seed"), ("agentjet", "agentjet")):
        if body.get(theirs) is not None:
            chat[ours] = body[theirs]


# --- OpenAI Responses API ----------------------------------------------------------------------

RESPONSES_STATELESS = (
    "this server keeps no stored responses or conversations; send the whole conversation in 'input' "
    "(earlier messages, function_call and function_call_output items) and leave {what} out"
)


def _text_of(content: Any, where: str, kinds: tuple[str, ...]) -> str:
    """Text of a string or a list of text parts of the given ``kinds`` (other parts are refused)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise DialectError(f"{where} must be a string or a list of content parts", where)
    out = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in kinds and isinstance(part.get("text"), str):
            out.append(part["text"])
        else:
            raise DialectError(
                f"{where}[{k}] is a {kind!r} part; this server takes text only ({', '.join(kinds)})", f"{where}[{k}]"
            )
    return "".join(out)


def _arguments(value: Any, where: str) -> str:
    """Tool-call arguments as a JSON object string."""
    if isinstance(value, dict):
        return json.dumps(value)
    if isinstance(value, str):
        try:
            parsed = json.loads(value or "{}")
        except ValueError as exc:
            raise DialectError(f"{where} is not JSON: {exc}", where) from exc
        if not isinstance(parsed, dict):
            raise DialectError(f"{where} must be a JSON object", where)
        return value or "{}"
    raise DialectError(f"{where} must be a JSON object", where)


def responses_to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat request a Responses API request means (its ``agentjet`` extension carried over)."""
    for what in ("previous_response_id", "conversation", "prompt"):
        if body.get(what):
            raise DialectError(RESPONSES_STATELESS.format(what=f"'{what}'"), what)
    if body.get("background"):
        raise DialectError("background responses are not served here; leave 'background' out", "background")
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        text = (
            instructions if isinstance(instructions, str) else _text_of(instructions, "instructions", ("input_text",))
        )
        messages.append({"role": "system", "content": text})
    items = body.get("input")
    if items is None:
        raise DialectError("'input' is required: a string, or a list of message and function-call items", "input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise DialectError("'input' must be a string or a list of items", "input")
    for k, item in enumerate(items):
        _responses_item(item, f"input[{k}]", messages)
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    _responses_tools(body, chat)
    _copy_set(body, chat, (("max_tokens", "max_output_tokens"), ("temperature", "temperature"), ("top_p", "top_p")))
    if body.get("top_logprobs"):
        chat["logprobs"], chat["top_logprobs"] = True, body["top_logprobs"]
    text_format = (body.get("text") or {}).get("format") or {}
    if text_format.get("type") == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif text_format.get("type") == "json_schema":  # Responses' flat form; chat nests it under json_schema
        spec = {key: text_format[key] for key in ("name", "schema", "strict", "description") if key in text_format}
        chat["response_format"] = {"type": "json_schema", "json_schema": spec}
    elif text_format.get("type") not in (None, "text"):
        raise DialectError("text.format type must be text, json_object or json_schema", "text.format")
    return chat


def _responses_item(item: Any, where: str, messages: list[dict[str, Any]]) -> None:
    """One ``input`` item of a Responses request, added to ``messages`` as the chat messages it means."""
    if not isinstance(item, dict):
        raise DialectError(f"{where} must be an object", where)
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise DialectError(f"{where}.role must be user, system, developer or assistant", f"{where}.role")
        kinds = ("output_text", "refusal") if role == "assistant" else ("input_text", "output_text")
        text = _text_of(item.get("content"), f"{where}.content", kinds)
        if role == "assistant" and messages and messages[-1]["role"] == "assistant" and not messages[-1]["content"]:
            messages[-1]["content"] = text  # text that follows a reasoning item of the same turn
        else:
            messages.append({"role": "system" if role == "developer" else role, "content": text})
    elif kind == "function_call":
        call_id, name = str(item.get("call_id") or item.get("id") or ""), str(item.get("name") or "")
        if not call_id or not name:
            raise DialectError(f"{where} (a function_call) needs call_id and name", where)
        arguments = _arguments(item.get("arguments", "{}"), f"{where}.arguments")
        call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":  # calls of one turn join its message
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        text = output if isinstance(output, str) else _text_of(output, f"{where}.output", ("input_text",))
        messages.append({"role": "tool", "tool_call_id": str(item.get("call_id") or ""), "content": text})
    elif kind == "reasoning":
        # the turn's reasoning: the chat template decides whether the history shows it
        parts = item.get("content") or []
        thought = "".join(
            str(p.get("text") or "") for p in parts if isinstance(p, dict) and p.get("type") == "reasoning_text"
        )
        if thought:
            messages.append({"role": "assistant", "content": "", "reasoning_content": thought})
    elif kind == "item_reference":
        raise DialectError(RESPONSES_STATELESS.format(what="item references"), where)
    else:
        raise DialectError(
            f"{where} is a {kind!r} item; this server takes message, function_call and function_call_output items",
            f"{where}.type",
        )


def _responses_tools(body: dict[str, Any], chat: dict[str, Any]) -> None:
    """A Responses request's function tools and tool choice, in the chat request's form."""
    tools = []
    for k, tool in enumerate(body.get("tools") or []):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise DialectError(
                f"tools[{k}] is a {kind!r} tool; this server runs function tools only (the agent runs them)",
                f"tools[{k}]",
            )
        function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}
        tools.append({"type": "function", "function": function})
    if tools:
        chat["tools"] = tools
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not choice.get("name"):
            raise DialectError("tool_choice must be auto, none, required or {type: function, name}", "tool_choice")
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif choice is not None:
        chat["tool_choice"] = choice


def responses_answer(response: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """A Responses API response's answer as chat text and tool calls."""
    text, calls = [], []
    for item in response.get("output") or []:
        if item.get("type") == "message":
            text.append(_text_of(item.get("content"), "output", ("output_text", "refusal")))
        elif item.get("type") == "function_call":
            calls.append({"function": {"name": item.get("name"), "arguments": item.get("arguments")}})
    return "".join(text), calls


# --- Anthropic Messages API --------------------------------------------------------------------


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise DialectError(f"{where} must be a string or a list of content blocks", where)
    for k, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise DialectError(f"{where}[{k}] must be a content block with a 'type'", f"{where}[{k}]")
    return content


def _tool_result_text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for k, block in enumerate(_blocks(content, where)):
        if block["type"] != "text":
            raise DialectError(f"{where}[{k}] is a {block['type']!r} block; tool results are text here", where)
        parts.append(str(block.get("text") or ""))
    return "".join(parts)


def messages_to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat request an Anthropic Messages API request means."""
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system:
        text = system if isinstance(system, str) else _tool_result_text(system, "system")
        messages.append({"role": "system", "content": text})
    given = body.get("messages")
    if not isinstance(given, list) or not given:
        raise DialectError("'messages' must be a non-empty list of user and assistant messages", "messages")
    for k, message in enumerate(given):
        where = f"messages[{k}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant"):
            raise DialectError(f"{where}.role must be user or assistant", f"{where}.role")
        blocks = _blocks(message.get("content"), f"{where}.content")
        if role == "assistant":
            messages.append(_assistant_turn(blocks, where))
        else:
            messages += _user_turn(blocks, where)
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    if body.get("max_tokens") is None:
        raise DialectError("'max_tokens' is required (the Messages API has no default)", "max_tokens")
    chat["max_tokens"] = body["max_tokens"]
    _messages_tools(body, chat)
    _copy_set(body, chat, (("temperature", "temperature"), ("top_p", "top_p")))
    if body.get("top_k") not in (None, 0, -1):
        raise DialectError("top_k is not supported; leave it out", "top_k")
    stops = body.get("stop_sequences")
    if stops:
        chat["stop"] = stops
    return chat


def _assistant_turn(blocks: list[dict[str, Any]], where: str) -> dict[str, Any]:
    """An assistant turn's blocks (text, tool_use, thinking) as one chat message."""
    said: list[str] = []
    thoughts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        kind = block["type"]
        if kind == "text":
            said.append(str(block.get("text") or ""))
        elif kind == "tool_use":
            arguments = _arguments(block.get("input", {}), f"{where}.content[{j}].input")
            function = {"name": str(block.get("name") or ""), "arguments": arguments}
            calls.append({"id": str(block.get("id") or ""), "type": "function", "function": function})
        elif kind == "thinking":
            thoughts.append(str(block.get("thinking") or ""))  # the template decides whether it shows
        elif kind == "redacted_thinking":
            continue  # nothing readable: the sampled reasoning is in the turn's tokens
        else:
            raise DialectError(
                f"{where}.content[{j}] is a {kind!r} block; assistant turns hold text and tool_use here",
                f"{where}.content[{j}]",
            )
    out: dict[str, Any] = {"role": "assistant", "content": "".join(said)}
    if "".join(thoughts):
        out["reasoning_content"] = "".join(thoughts)
    if calls:
        out["tool_calls"] = calls
    return out


def _user_turn(blocks: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """A user turn's blocks as chat messages: its text, and a tool message per tool_result (in order)."""
    messages: list[dict[str, Any]] = []
    pending: list[str] = []
    for j, block in enumerate(blocks):
        kind = block["type"]
        if kind == "text":
            pending.append(str(block.get("text") or ""))
        elif kind == "tool_result":
            if pending:
                messages.append({"role": "user", "content": "".join(pending)})
                pending = []
            result = _tool_result_text(block.get("content"), f"{where}.content[{j}].content")
            messages.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id") or ""), "content": result})
        else:
            raise DialectError(
                f"{where}.content[{j}] is a {kind!r} block; user turns hold text and tool_result here",
                f"{where}.content[{j}]",
            )
    if pending or not blocks:
        messages.append({"role": "user", "content": "".join(pending)})
    return messages


def _messages_tools(body: dict[str, Any], chat: dict[str, Any]) -> None:
    """A Messages request's client tools and tool choice, in the chat request's form."""
    tools = []
    for k, tool in enumerate(body.get("tools") or []):
        if not isinstance(tool, dict) or "input_schema" not in tool or tool.get("type") not in (None, "custom"):
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise DialectError(
                f"tools[{k}] ({kind!r}) is not a client tool with an input_schema; this server runs those only",
                f"tools[{k}]",
            )
        function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        if tool.get("description"):
            function["description"] = tool["description"]
        tools.append({"type": "function", "function": function})
    if tools:
        chat["tools"] = tools
    choice = body.get("tool_choice")
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        mapped = {"auto": "auto", "any": "required", "none": "none"}
        if kind in mapped:
            chat["tool_choice"] = mapped[kind]
        elif kind == "tool" and choice.get("name"):
            chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
        else:
            raise DialectError("tool_choice must be {type: auto | any | none} or {type: tool, name}", "tool_choice")


def messages_answer(message: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """An Anthropic message's answer as chat text and tool calls."""
    text, calls = [], []
    for block in message.get("content") or []:
        if block.get("type") == "text":
            text.append(str(block.get("text") or ""))
        elif block.get("type") == "tool_use":
            calls.append({"function": {"name": block.get("name"), "arguments": json.dumps(block.get("input") or {})}})
    return "".join(text), calls
