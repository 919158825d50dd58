"""Answers in the shapes of the other APIs: OpenAI's Responses API and Anthropic's Messages API.

A request to ``/v1/responses`` or ``/v1/messages`` is turned into the chat request it means
(``agentjet_client.dialects``) and sampled by ``ChatService`` like any chat request; these
functions write the chat answer (whole, or its stream of chunks) back as a Responses object and its
events, or as an Anthropic message and its events. Each carries the chat choice's ``agentjet``
extension (exact token ids, log-probabilities, versions, signature) as a top-level ``agentjet``
field: on the response object (and the ``response.completed`` event), on the message (and the
``message_delta`` event).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from agentjet_client.protocol import AgentJetExtension, ChatCompletion, ChatCompletionChunk


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


async def _after(
    first: ChatCompletionChunk, rest: AsyncIterator[ChatCompletionChunk]
) -> AsyncIterator[ChatCompletionChunk]:
    """``first``, then the rest of the chunks."""
    yield first
    async for chunk in rest:
        yield chunk


def _sse(event: str, data: dict[str, Any]) -> str:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


# --- Responses ---------------------------------------------------------------------------------


def _response_shell(body: dict[str, Any], model: str, response_id: str, created: int) -> dict[str, Any]:
    """The fields of a Responses object that echo the request."""
    tools = [t for t in body.get("tools") or [] if isinstance(t, dict)]
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": "in_progress",
        "error": None,
        "incomplete_details": None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "model": model,
        "output": [],
        "parallel_tool_calls": bool(body.get("parallel_tool_calls", True)),
        "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None},
        "store": False,
        "temperature": body.get("temperature", 1.0),
        "text": {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": tools,
        "top_p": body.get("top_p", 1.0),
        "truncation": "disabled",
        "usage": None,
        "user": None,
        "metadata": body.get("metadata") or {},
    }


def _response_usage(ext: AgentJetExtension) -> dict[str, Any]:
    prompt, completion = len(ext.prompt_token_ids), len(ext.completion_token_ids)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def _message_item(text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": _id("msg"), "status": status, "role": "assistant", "content": content}


def _reasoning_item(text: str, item_id: str | None = None) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": item_id or _id("rs"),
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": None,
    }


def _call_item(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": _id("fc"),
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": "completed",
    }


def _finish(response: dict[str, Any], ext: AgentJetExtension) -> None:
    truncated = ext.finish_reason == "length"
    response["status"] = "incomplete" if truncated else "completed"
    response["incomplete_details"] = {"reason": "max_output_tokens"} if truncated else None
    response["usage"] = _response_usage(ext)
    response["agentjet"] = ext.model_dump(exclude_none=True)


def response_object(completion: ChatCompletion, body: dict[str, Any]) -> dict[str, Any]:
    """A whole chat completion (one choice) as a Responses API response."""
    choice = completion.choices[0]
    response = _response_shell(body, completion.model, _id("resp"), completion.created)
    calls = choice.message.tool_calls or []
    if choice.message.reasoning:
        response["output"].append(_reasoning_item(choice.message.reasoning))
    if choice.message.content or not calls:
        response["output"].append(_message_item(choice.message.content or ""))
    for call in calls:
        response["output"].append(_call_item(call.id, call.function.name, call.function.arguments))
    assert choice.agentjet is not None
    _finish(response, choice.agentjet)
    return response


async def response_events(chunks: AsyncIterator[ChatCompletionChunk], body: dict[str, Any]) -> AsyncIterator[str]:
    """A streamed chat answer as the Responses API's events (``response.created`` ... ``response.completed``)."""
    first = await anext(chunks)  # a bad request raises here, before any event is sent
    response = _response_shell(body, first.model, _id("resp"), int(time.time()))
    sequence = 0

    def event(kind: str, **data: Any) -> str:
        nonlocal sequence
        sequence += 1
        return _sse(kind, {"type": kind, "sequence_number": sequence - 1, **data})

    yield event("response.created", response=dict(response))
    yield event("response.in_progress", response=dict(response))
    text_item: dict[str, Any] | None = None
    text = ""
    thought_id: str | None = None  # the reasoning item while it streams
    thought = ""
    text_done = False
    ext: AgentJetExtension | None = None
    calls: list[tuple[str, str, str]] = []

    def close_reasoning() -> list[str]:
        nonlocal thought_id
        if thought_id is None:
            return []
        done, at = _reasoning_item(thought, thought_id), len(response["output"])
        out = [
            event("response.reasoning_text.done", item_id=thought_id, output_index=at, content_index=0, text=thought),
            event("response.output_item.done", output_index=at, item=done),
        ]
        response["output"].append(done)
        thought_id = None
        return out

    def close_text() -> list[str]:
        nonlocal text_item
        if text_item is None:
            return []
        done = _message_item(text)
        done["id"] = text_item["id"]
        part, at = done["content"][0], len(response["output"])
        out = [
            event(
                "response.output_text.done",
                item_id=done["id"],
                output_index=at,
                content_index=0,
                text=text,
                logprobs=[],
            ),
            event("response.content_part.done", item_id=done["id"], output_index=at, content_index=0, part=part),
            event("response.output_item.done", output_index=at, item=done),
        ]
        response["output"].append(done)
        text_item = None
        return out

    async for chunk in _after(first, chunks):
        for choice in chunk.choices:
            if choice.delta.reasoning and text_item is None and not text_done:
                at = len(response["output"])
                if thought_id is None:
                    thought_id = _id("rs")
                    item = {**_reasoning_item("", thought_id), "content": []}
                    yield event("response.output_item.added", output_index=at, item=item)
                thought += choice.delta.reasoning
                yield event(
                    "response.reasoning_text.delta",
                    item_id=thought_id,
                    output_index=at,
                    content_index=0,
                    delta=choice.delta.reasoning,
                )
            if choice.delta.content:
                for out in close_reasoning():
                    yield out
                at = len(response["output"])
                if text_item is None and not text_done:
                    text_item = _message_item("", status="in_progress")
                    text_item["content"] = []
                    yield event("response.output_item.added", output_index=at, item=text_item)
                    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                    yield event(
                        "response.content_part.added",
                        item_id=text_item["id"],
                        output_index=at,
                        content_index=0,
                        part=part,
                    )
                if text_item is not None:
                    text += choice.delta.content
                    yield event(
                        "response.output_text.delta",
                        item_id=text_item["id"],
                        output_index=at,
                        content_index=0,
                        delta=choice.delta.content,
                        logprobs=[],
                    )
            for call in choice.delta.tool_calls or []:
                function = call.function or {}
                calls.append((call.id or _id("call"), function.get("name", ""), function.get("arguments", "")))
            if choice.agentjet is not None:
                ext = choice.agentjet
    for out in close_reasoning() + close_text():
        yield out
    if ext is None:
        return  # the chat stream ended without its extension: the route reports the failure
    if not calls and not any(item["type"] == "message" for item in response["output"]):
        at = len(response["output"])
        response["output"].append(_message_item(""))  # an empty answer is still one message
        yield event("response.output_item.added", output_index=at, item=response["output"][at])
        yield event("response.output_item.done", output_index=at, item=response["output"][at])
    for call_id, name, arguments in calls:
        index = len(response["output"])
        item = _call_item(call_id, name, arguments)
        yield event(
            "response.output_item.added", output_index=index, item={**item, "arguments": "", "status": "in_progress"}
        )
        yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=index, delta=arguments)
        yield event(
            "response.function_call_arguments.done",
            item_id=item["id"],
            output_index=index,
            arguments=arguments,
            name=name,
        )
        yield event("response.output_item.done", output_index=index, item=item)
        response["output"].append(item)
    _finish(response, ext)
    # as vLLM's server does: the final event is response.completed even when the response is
    # incomplete (its status says so), which is what SDKs wait for to hand back the final response
    yield event("response.completed", response=response)


def response_error_event(message: str, error_type: str) -> str:
    """The event that ends a Responses stream which failed after it started."""
    return _sse("error", {"type": "error", "code": error_type, "message": message, "param": None, "sequence_number": 0})


def message_error_event(message: str, error_type: str) -> str:
    """The event that ends a Messages stream which failed after it started."""
    kind = "invalid_request_error" if error_type == "invalid_request_error" else "api_error"
    return _sse("error", {"type": "error", "error": {"type": kind, "message": message}})


# --- Anthropic Messages ------------------------------------------------------------------------


def _stop_reason(ext: AgentJetExtension, text_stop: str | None) -> tuple[str, str | None]:
    if ext.finish_reason == "tool_calls":
        return "tool_use", None
    if ext.finish_reason == "length":
        return "max_tokens", None
    return ("stop_sequence", text_stop) if text_stop is not None else ("end_turn", None)


def matched_stop(
    ext: AgentJetExtension, text: str, body: dict[str, Any], decode: Callable[[list[int]], str]
) -> str | None:
    """The stop sequence that ended the answer, if one did (the answer's text ends where it began)."""
    stops = [s for s in body.get("stop_sequences") or [] if isinstance(s, str) and s]
    if not stops or ext.finish_reason != "stop":
        return None
    rest = decode(ext.completion_token_ids)[len(text) :]
    hits = [(rest.find(s), s) for s in stops if rest.find(s) >= 0]
    return min(hits)[1] if hits else None


def _message_usage(ext: AgentJetExtension) -> dict[str, Any]:
    return {
        "input_tokens": len(ext.prompt_token_ids),
        "output_tokens": len(ext.completion_token_ids),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


def _tool_use(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"type": "tool_use", "id": call_id, "name": name, "input": json.loads(arguments or "{}")}


def message_object(
    completion: ChatCompletion, body: dict[str, Any], decode: Callable[[list[int]], str]
) -> dict[str, Any]:
    """A whole chat completion (one choice) as an Anthropic message."""
    choice = completion.choices[0]
    ext = choice.agentjet
    assert ext is not None
    content: list[dict[str, Any]] = []
    if choice.message.reasoning:
        content.append({"type": "thinking", "thinking": choice.message.reasoning, "signature": ""})
    text = choice.message.content or ""
    if text or not choice.message.tool_calls:
        content.append({"type": "text", "text": text})
    for call in choice.message.tool_calls or []:
        content.append(_tool_use(call.id, call.function.name, call.function.arguments))
    reason, sequence = _stop_reason(ext, matched_stop(ext, text, body, decode))
    return {
        "id": _id("msg"),
        "type": "message",
        "role": "assistant",
        "model": completion.model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": _message_usage(ext),
        "agentjet": ext.model_dump(exclude_none=True),
    }


async def message_events(
    chunks: AsyncIterator[ChatCompletionChunk], body: dict[str, Any], decode: Callable[[list[int]], str]
) -> AsyncIterator[str]:
    """A streamed chat answer as the Messages API's events (``message_start`` ... ``message_stop``)."""
    first = await anext(chunks)  # a bad request raises here, before any event is sent
    message: dict[str, Any] = {
        "id": _id("msg"),
        "type": "message",
        "role": "assistant",
        "model": first.model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": 0, "output_tokens": 0},
    }
    yield _sse("message_start", {"type": "message_start", "message": message})
    blocks = 0  # blocks closed so far
    thinking = False  # a thinking block is open
    text_open = False
    text = ""
    ext: AgentJetExtension | None = None
    calls: list[tuple[str, str, str]] = []

    def close_thinking() -> list[str]:
        nonlocal thinking, blocks
        if not thinking:
            return []
        thinking, blocks = False, blocks + 1
        signature = {"type": "signature_delta", "signature": ""}
        return [
            _sse("content_block_delta", {"type": "content_block_delta", "index": blocks - 1, "delta": signature}),
            _sse("content_block_stop", {"type": "content_block_stop", "index": blocks - 1}),
        ]

    async for chunk in _after(first, chunks):
        for choice in chunk.choices:
            if choice.delta.reasoning and not text_open:
                if not thinking:
                    thinking = True
                    block = {"type": "thinking", "thinking": "", "signature": ""}
                    yield _sse(
                        "content_block_start", {"type": "content_block_start", "index": blocks, "content_block": block}
                    )
                delta = {"type": "thinking_delta", "thinking": choice.delta.reasoning}
                yield _sse("content_block_delta", {"type": "content_block_delta", "index": blocks, "delta": delta})
            if choice.delta.content:
                for out in close_thinking():
                    yield out
                if not text_open:
                    text_open = True
                    block = {"type": "text", "text": ""}
                    yield _sse(
                        "content_block_start", {"type": "content_block_start", "index": blocks, "content_block": block}
                    )
                text += choice.delta.content
                delta = {"type": "text_delta", "text": choice.delta.content}
                yield _sse("content_block_delta", {"type": "content_block_delta", "index": blocks, "delta": delta})
            for call in choice.delta.tool_calls or []:
                function = call.function or {}
                calls.append((call.id or _id("toolu"), function.get("name", ""), function.get("arguments", "")))
            if choice.agentjet is not None:
                ext = choice.agentjet
    for out in close_thinking():
        yield out
    if ext is None:
        return  # the chat stream ended without its extension: the route reports the failure
    if not text_open and not calls:  # an empty answer is one empty text block
        text_open = True
        block = {"type": "text", "text": ""}
        yield _sse("content_block_start", {"type": "content_block_start", "index": blocks, "content_block": block})
    if text_open:
        yield _sse("content_block_stop", {"type": "content_block_stop", "index": blocks})
        blocks += 1
    for call_id, name, arguments in calls:
        use: dict[str, Any] = {"type": "tool_use", "id": call_id, "name": name, "input": {}}
        yield _sse("content_block_start", {"type": "content_block_start", "index": blocks, "content_block": use})
        delta = {"type": "input_json_delta", "partial_json": arguments}
        yield _sse("content_block_delta", {"type": "content_block_delta", "index": blocks, "delta": delta})
        yield _sse("content_block_stop", {"type": "content_block_stop", "index": blocks})
        blocks += 1
    reason, sequence = _stop_reason(ext, matched_stop(ext, text, body, decode))
    yield _sse(
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": _message_usage(ext),
            "agentjet": ext.model_dump(exclude_none=True),
        },
    )
    yield _sse("message_stop", {"type": "message_stop"})
