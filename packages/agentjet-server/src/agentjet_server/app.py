"""HTTP routes: thin glue from Starlette requests to ``SwarmRuntime`` calls.

Every non-2xx answer is OpenAI's error shape, chosen by exception class: the caller's mistakes
(``RequestError`` and pydantic validation errors) are 4xx with a message that says what is
wrong and how to fix it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
from collections.abc import AsyncIterator, Coroutine, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
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
from agentjet_server.engine.base import Engine
from agentjet_server.errors import (
    AuthenticationError,
    EngineError,
    InvalidRequestError,
    PayloadTooLargeError,
    RequestError,
    StateError,
)
from agentjet_server.runtime import SwarmRuntime
from agentjet_server.settings import ServerSettings

logger = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


def error_response(
    status: int, message: str, error_type: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    body = ErrorResponse(error=ErrorDetail(message=message, type=error_type, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status)


def describe_validation_error(exc: ValidationError) -> tuple[str, str | None]:
    """One readable sentence per problem, e.g. ``messages.0.role: Input should be ...``."""
    parts = []
    first_param = None
    for err in exc.errors()[:8]:
        loc = ".".join(str(x) for x in err["loc"]) or "body"
        first_param = first_param or loc
        if err["type"] == "extra_forbidden":
            parts.append(f"{loc}: unknown field; remove it or check its spelling")
        elif err["type"] == "missing":
            parts.append(f"{loc}: required field is missing")
        else:
            parts.append(f"{loc}: {err['msg']} (got {json.dumps(err.get('input'), default=str)[:80]})")
    more = len(exc.errors()) - 8
    if more > 0:
        parts.append(f"... and {more} more problems")
    return "invalid request: " + "; ".join(parts), first_param


async def read_model(request: Request, model: type[M], limit: int) -> M:
    """Read, size-check and validate a JSON body."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLargeError(
            f"request body is {declared} bytes; the limit is {limit} bytes. Send smaller batches",
            code="payload_too_large",
        )
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLargeError(
                f"request body exceeds the limit of {limit} bytes. Send smaller batches", code="payload_too_large"
            )
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw:
        raise InvalidRequestError("request body is empty; send a JSON object")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise InvalidRequestError(f"request body must be a JSON object, not {type(data).__name__}")
    return model.model_validate(data)


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
        body = await read_model(request, ChatCompletionRequest, settings.max_body_bytes)
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
                async for frame in frames:
                    yield frame

            return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        completion = await _unless_disconnected(request, rt.chat.complete(body, rt.engine.model_name))
        if completion is None:  # nobody is waiting for it any more
            return Response(status_code=499)
        return Response(completion.model_dump_json(exclude_none=True), media_type="application/json")

    async def trajectories(request: Request) -> Response:
        authorize(request)
        batch = await read_model(request, TrajectoryBatch, settings.max_body_bytes)
        # the answer waits for the log's fsync; a thread keeps that off the event loop
        result = await asyncio.to_thread(rt.ingest, batch)
        return JSONResponse(result.model_dump())

    async def status(request: Request) -> Response:
        authorize(request)
        return JSONResponse(rt.status().model_dump())

    async def on_request_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestError)
        return error_response(exc.status_code, exc.message, exc.error_type, exc.param, exc.code)

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
        yield
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
