"""HTTP routes: thin glue from Starlette requests to ``SwarmRuntime`` calls.

Every non-2xx answer is OpenAI's error shape, chosen by exception class: the caller's mistakes
(``RequestError`` and pydantic validation errors) are 4xx with a message that says what is
wrong and how to fix it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import AsyncIterator, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from agentjet_client.protocol import (
    ChatCompletionRequest,
    ErrorDetail,
    ErrorResponse,
    Health,
    ModelCard,
    ModelList,
    TrajectoryBatch,
)
from agentjet_server.bodies import LARGE_IN_FLIGHT, describe_validation_error, read_model
from agentjet_server.body_gate import BodyGate
from agentjet_server.engine.base import Engine
from agentjet_server.errors import (
    AuthenticationError,
    EngineError,
    InvalidRequestError,
    RateLimitError,
    RequestError,
    StateError,
)
from agentjet_server.runtime import SwarmRuntime
from agentjet_server.settings import ServerSettings

logger = logging.getLogger(__name__)
T = TypeVar("T")
WORKER_THREADS = "agentjet-server-worker"


def _printable(text: str | None) -> str | None:
    """Text that can be sent as UTF-8 (a message may quote what the caller sent, lone surrogates included)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8") if text is not None else None


def error_response(
    status: int,
    message: str,
    error_type: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    detail = ErrorDetail(message=_printable(message) or "", type=error_type, param=_printable(param), code=code)
    return JSONResponse(ErrorResponse(error=detail).model_dump(), status_code=status, headers=headers)


def error_frame(message: str, error_type: str = "server_error", code: str | None = None) -> str:
    """An SSE event that ends a stream which failed after its first frame (then ``[DONE]`` follows)."""
    detail = ErrorDetail(message=_printable(message) or "", type=error_type, code=code)
    return f"data: {ErrorResponse(error=detail).model_dump_json()}\n\n"


async def _unless_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T | None:
    """Run ``work``; if the client hangs up first, cancel it (the engine drops the request) and return None."""
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.25)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            logger.info("client disconnected from %s; generation cancelled", request.url.path)
            return None


def _key_in(token: str, keys: Sequence[str]) -> bool:
    return any(hmac.compare_digest(token.encode(), k.encode()) for k in keys)


def create_app(
    engine: Engine, settings: ServerSettings, runtime: SwarmRuntime | None = None, model_path: str | None = None
) -> Starlette:
    """The ASGI app. ``runtime`` defaults to a new one over ``engine`` (its learner starts now)."""
    rt = runtime or SwarmRuntime.create(engine, settings, model_path or str(getattr(engine, "model_path", "")))
    gate = BodyGate()  # judges large bodies in a process of its own (started on first use)
    large = asyncio.Semaphore(LARGE_IN_FLIGHT)

    def authorize(request: Request) -> None:
        if not settings.auth_enabled:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise AuthenticationError("missing API key: send 'Authorization: Bearer <key>'", code="missing_api_key")
        if not _key_in(token.strip(), settings.api_keys + settings.admin_keys):
            raise AuthenticationError("the API key is not valid for this server", code="invalid_api_key")

    async def healthz(request: Request) -> Response:
        return JSONResponse(Health(policy_version=rt.version).model_dump())

    async def models(request: Request) -> Response:
        authorize(request)
        card = ModelCard(id=rt.engine.model_name, created=int(rt.started))
        return JSONResponse(ModelList(data=[card]).model_dump())

    async def chat_completions(request: Request) -> Response:
        authorize(request)
        body = await read_model(
            request, ChatCompletionRequest, settings.max_chat_body_bytes, settings.body_timeout_s, gate, large
        )
        if body.model not in (None, "", rt.engine.model_name, "default"):
            raise InvalidRequestError(
                f"model '{body.model}' is not served here; this server serves '{rt.engine.model_name}' "
                "(see GET /v1/models)",
                param="model",
                code="model_not_found",
            )
        if body.stream:
            frames = rt.chat.stream(body, rt.engine.model_name)
            first = await anext(frames)  # surface request errors as a 4xx before streaming starts

            async def stream() -> AsyncIterator[str]:
                yield first
                try:
                    async for frame in frames:
                        yield frame
                except Exception as exc:  # the 200 is sent: the client learns of the failure from the stream
                    logger.exception("stream on %s failed after its first frame", request.url.path)
                    if isinstance(exc, RequestError):
                        yield error_frame(exc.message, exc.error_type, exc.code)
                    elif isinstance(exc, EngineError):
                        yield error_frame(str(exc), "engine_error")
                    else:
                        yield error_frame(f"the stream failed: {type(exc).__name__}; see the server log")
                    yield "data: [DONE]\n\n"

            return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        completion = await _unless_disconnected(request, rt.chat.complete(body, rt.engine.model_name))
        if completion is None:  # nobody is waiting for it any more
            return Response(status_code=499)
        usage = completion.usage
        if usage is not None and usage.completion_tokens > 2048:  # a large answer is rendered off the event loop
            text = await asyncio.to_thread(completion.model_dump_json, exclude_none=True)
        else:
            text = completion.model_dump_json(exclude_none=True)
        return Response(text, media_type="application/json")

    async def trajectories(request: Request) -> Response:
        authorize(request)
        batch = await read_model(
            request, TrajectoryBatch, settings.max_body_bytes, settings.body_timeout_s, gate, large
        )
        # the answer waits for the log's fsync; a thread keeps that off the event loop
        result = await asyncio.to_thread(rt.ingest, batch)
        return JSONResponse(result.model_dump())

    async def status(request: Request) -> Response:
        authorize(request)
        return JSONResponse(rt.status().model_dump())

    async def on_request_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestError)
        headers = {"Retry-After": str(max(1, round(exc.retry_after)))} if isinstance(exc, RateLimitError) else None
        return error_response(exc.status_code, exc.message, exc.error_type, exc.param, exc.code, headers)

    async def on_validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ValidationError)
        message, param = describe_validation_error(exc)
        return error_response(400, message, "invalid_request_error", param, "invalid_value")

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        hint = {
            404: f"no route {request.url.path}; see /v1/models, /v1/chat/completions, /v1/trajectories, /v1/status",
            405: f"method {request.method} is not allowed on {request.url.path}",
        }.get(exc.status_code, str(exc.detail))
        return error_response(
            exc.status_code, hint, "invalid_request_error" if exc.status_code < 500 else "server_error"
        )

    async def on_engine_error(request: Request, exc: Exception) -> Response:
        logger.error("engine error on %s: %s", request.url.path, exc)
        return error_response(500, str(exc), "engine_error")

    async def on_state_error(request: Request, exc: Exception) -> Response:
        # nothing was acknowledged: the client keeps the batch and retries
        logger.error("state error on %s: %s", request.url.path, exc)
        return error_response(503, f"{exc}; nothing in this request was acknowledged, retry later", "server_error")

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        logger.exception("unexpected error on %s", request.url.path)
        return error_response(500, f"internal error ({type(exc).__name__}); see the server log", "server_error")

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # CPU work (parsing, rendering, detokenising) and fsyncs run in worker threads that say
        # whose they are (``asyncio.to_thread`` uses the loop's default executor)
        workers = ThreadPoolExecutor(thread_name_prefix=WORKER_THREADS)
        asyncio.get_running_loop().set_default_executor(workers)
        yield
        gate.close()
        rt.close()

    app = Starlette(
        routes=[
            Route("/healthz", healthz, methods=["GET"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/trajectories", trajectories, methods=["POST"]),
            Route("/v1/status", status, methods=["GET"]),
        ],
        exception_handlers={
            RequestError: on_request_error,
            ValidationError: on_validation_error,
            HTTPException: on_http_error,
            EngineError: on_engine_error,
            StateError: on_state_error,
            Exception: on_unexpected,
        },
        lifespan=lifespan,
    )
    app.state.runtime = rt
    return app
