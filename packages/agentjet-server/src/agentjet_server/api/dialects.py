"""OpenAI's Responses API and Anthropic's Messages API: each request is read as the chat request it means
(``agentjet_client.dialects``), sampled by the chat service like any other, and its answer (or stream)
shaped back into the API's own objects and events (``serving.dialects``). Stateless: no stored responses."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from agentjet_client.dialects import DialectError, messages_to_chat, responses_to_chat
from agentjet_client.protocol import ChatCompletionRequest
from agentjet_server.api.auth import authorize
from agentjet_server.api.chat import check_model, streamed, whole
from agentjet_server.api.context import api_of, runtime_of
from agentjet_server.errors import InvalidRequestError
from agentjet_server.ingest.bodies import parse_json, read_body
from agentjet_server.serving import dialects


async def dialect_request(
    request: Request, to_chat: Callable[[dict[str, Any]], dict[str, Any]]
) -> tuple[dict[str, Any], ChatCompletionRequest]:
    """The request body and the chat request it means (one choice, streamed or not)."""
    settings = api_of(request).settings
    raw = await read_body(request, settings.max_chat_body_bytes, settings.body_timeout_s)
    data = await asyncio.to_thread(parse_json, raw) if len(raw) > 1 << 16 else parse_json(raw)
    try:
        chat = to_chat(data)
    except DialectError as exc:
        raise InvalidRequestError(exc.message, param=exc.param) from None
    body = ChatCompletionRequest.model_validate({**chat, "stream": bool(data.get("stream"))})
    check_model(request, body)
    return data, body


async def responses(request: Request) -> Response:
    """OpenAI's Responses API, stateless: the answer as output items, events when streamed."""
    authorize(request)
    rt = runtime_of(request)
    data, body = await dialect_request(request, responses_to_chat)
    if body.stream:
        events = dialects.response_events(rt.chat.stream_chunks(body, rt.engine.model_name), data)
        return await streamed(request, events, dialects.response_error_event)
    return await whole(request, body, lambda completion: dialects.response_object(completion, data))


async def messages(request: Request) -> Response:
    """Anthropic's Messages API: the answer as content blocks, events when streamed."""
    authorize(request)
    rt = runtime_of(request)
    data, body = await dialect_request(request, messages_to_chat)
    decode = rt.engine.decode
    if body.stream:
        events = dialects.message_events(rt.chat.stream_chunks(body, rt.engine.model_name), data, decode)
        return await streamed(request, events, dialects.message_error_event)
    return await whole(request, body, lambda completion: dialects.message_object(completion, data, decode))


ROUTES = [
    Route("/v1/responses", responses, methods=["POST"]),
    Route("/v1/messages", messages, methods=["POST"]),
]
