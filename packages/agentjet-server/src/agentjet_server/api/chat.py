"""Chat completions, text completions and ``/v1/models``, and the glue every sampling route shares: an
answer is dropped when its caller hangs up (``unless_disconnected``), a stream surfaces request errors as
a 4xx before its first frame and later failures as an error frame (``streamed``)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from agentjet_client.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from agentjet_server.api.auth import authorize
from agentjet_server.api.context import api_of, runtime_of
from agentjet_server.api.errors import error_frame
from agentjet_server.errors import EngineError, InvalidRequestError, RequestError
from agentjet_server.ingest.bodies import read_model

logger = logging.getLogger(__name__)
T = TypeVar("T")


DISCONNECT_POLL_S = 0.25  # how often a request being answered checks that its caller is still there


async def unless_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T | None:
    """Run ``work`` in this task; if the client hangs up first, cancel it (the engine drops the request)
    and return None. A timer looks for the hang-up every quarter second, so an answer that is ready sooner
    costs the event loop one timer, not a task of its own."""
    loop = asyncio.get_running_loop()
    current = asyncio.current_task()
    assert current is not None
    done = hung_up = False
    probing: asyncio.Task[None] | None = None
    timer: asyncio.TimerHandle  # the next look, set below

    async def probe() -> None:
        nonlocal hung_up, timer
        if await request.is_disconnected():
            if not done:
                hung_up = True
                current.cancel()
        elif not done:
            timer = loop.call_later(DISCONNECT_POLL_S, look)

    def look() -> None:
        nonlocal probing
        probing = loop.create_task(probe())

    timer = loop.call_later(DISCONNECT_POLL_S, look)
    try:
        return await work
    except asyncio.CancelledError:
        if not hung_up:
            raise
        current.uncancel()
        logger.info("client disconnected from %s; generation cancelled", request.url.path)
        return None
    finally:
        done = True
        timer.cancel()
        if probing is not None and not probing.done():
            probing.cancel()


def check_model(request: Request, body: ChatCompletionRequest | CompletionRequest) -> None:
    # a call that comes through an AgentJet client's capture (it carries the ``agentjet``
    # extension) was routed here for its agent: agent code written for another model name
    # (``gpt-4o-mini``) trains unchanged, and its turn records both names
    engine = runtime_of(request).engine
    served = engine.model_name
    if body.agentjet is None and body.model not in (None, "", served, "default", *engine.adapters):
        raise InvalidRequestError(
            f"model '{body.model}' is not served here; this server serves '{served}' (see GET /v1/models)",
            param="model",
            code="model_not_found",
        )


def chat_error(message: str, error_type: str) -> str:
    return error_frame(message, error_type) + "data: [DONE]\n\n"


async def streamed(request: Request, frames: AsyncIterator[str], sse_error: Callable[[str, str], str]) -> Response:
    """An SSE answer; a request error surfaces as a 4xx before the first frame is sent."""
    first = await anext(frames)

    async def stream() -> AsyncIterator[str]:
        yield first
        try:
            async for frame in frames:
                yield frame
        except Exception as exc:  # the 200 is sent: the client learns of the failure from the stream
            logger.exception("stream on %s failed after its first frame", request.url.path)
            if isinstance(exc, RequestError):
                yield sse_error(exc.message, exc.error_type)
            elif isinstance(exc, EngineError):
                yield sse_error(str(exc), "engine_error")
            else:
                yield sse_error(f"the stream failed: {type(exc).__name__}; see the server log", "server_error")

    return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def whole(request: Request, body: ChatCompletionRequest, shape: Callable[[Any], Any] | None = None) -> Response:
    """A chat completion answered whole, as itself or ``shape``d into another API's answer."""
    rt = runtime_of(request)
    completion = await unless_disconnected(request, rt.chat.complete(body, rt.engine.model_name))
    if completion is None:  # nobody is waiting for it any more
        return Response(status_code=499)
    usage = completion.usage
    big = usage is not None and usage.completion_tokens > 2048  # a large answer is rendered off the event loop
    if shape is not None:
        data = await asyncio.to_thread(shape, completion) if big else shape(completion)
        return JSONResponse(data)
    if big:
        text = await asyncio.to_thread(completion.model_dump_json, exclude_none=True)
    else:
        text = completion.model_dump_json(exclude_none=True)
    return Response(text, media_type="application/json")


async def models(request: Request) -> Response:
    authorize(request)
    rt = runtime_of(request)
    created = int(time.time() - (time.monotonic() - rt.started))  # when the server started (Unix time)
    cards = [ModelCard(id=name, created=created) for name in (rt.engine.model_name, *rt.engine.adapters)]
    return JSONResponse(ModelList(data=cards).model_dump())


async def chat_completions(request: Request) -> Response:
    authorize(request)
    api = api_of(request)
    limit, timeout = api.settings.max_chat_body_bytes, api.settings.body_timeout_s
    body = await read_model(request, ChatCompletionRequest, limit, timeout, api.gate, api.large)
    check_model(request, body)
    if body.stream:
        return await streamed(request, api.runtime.chat.stream(body, api.runtime.engine.model_name), chat_error)
    return await whole(request, body)


async def completions(request: Request) -> Response:
    """Text completions (no chat template), as vLLM's server serves them."""
    authorize(request)
    api, rt = api_of(request), runtime_of(request)
    limit, timeout = api.settings.max_chat_body_bytes, api.settings.body_timeout_s
    body = await read_model(request, CompletionRequest, limit, timeout, api.gate, api.large)
    check_model(request, body)
    if body.stream:
        return await streamed(request, rt.text.stream(body, rt.engine.model_name), chat_error)
    completion = await unless_disconnected(request, rt.text.complete(body, rt.engine.model_name))
    if completion is None:  # nobody is waiting for it any more
        return Response(status_code=499)
    text = await asyncio.to_thread(completion.model_dump_json, exclude_none=True)
    return Response(text, media_type="application/json")


ROUTES = [
    Route("/v1/models", models, methods=["GET"]),
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
]
