"""Every non-2xx answer in OpenAI's error shape, picked by exception class: the caller's mistakes
(``RequestError`` and pydantic validation errors) are 4xx with a message that says what is wrong and how
to fix it; engine and state failures are 500 and 503 (nothing acknowledged: retry); anything else is a
500 that points at the server log. Streams that fail after their first frame end with an error frame."""

from __future__ import annotations

import logging

from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from agentjet_client.protocol import ErrorDetail, ErrorResponse
from agentjet_server.api.context import runtime_of
from agentjet_server.errors import EngineError, RateLimitError, RequestError, StateError
from agentjet_server.ingest.bodies import describe_validation_error

logger = logging.getLogger(__name__)

ROUTES_HINT = (
    "/v1/models, /v1/chat/completions, /v1/responses, /v1/messages, /v1/completions, /v1/trajectories, "
    "/v1/status, /metrics, /dashboard, /v1/admin/... (docs/protocol.md)"
)


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
        404: f"no route {request.url.path}; see {ROUTES_HINT}",
        405: f"method {request.method} is not allowed on {request.url.path}",
    }.get(exc.status_code, str(exc.detail))
    return error_response(exc.status_code, hint, "invalid_request_error" if exc.status_code < 500 else "server_error")


async def on_engine_error(request: Request, exc: Exception) -> Response:
    logger.error("engine error on %s: %s", request.url.path, exc)
    runtime_of(request).telemetry.record_event("engine", f"{request.url.path}: {exc}")
    return error_response(500, str(exc), "engine_error")


async def on_state_error(request: Request, exc: Exception) -> Response:
    # nothing was acknowledged: the client keeps the batch and retries
    logger.error("state error on %s: %s", request.url.path, exc)
    runtime_of(request).telemetry.record_event("state", f"{request.url.path}: {exc} (answered 503)")
    return error_response(503, f"{exc}; nothing in this request was acknowledged, retry later", "server_error")


async def on_unexpected(request: Request, exc: Exception) -> Response:
    logger.exception("unexpected error on %s", request.url.path)
    runtime_of(request).telemetry.record_event("internal", f"{request.url.path}: {type(exc).__name__}: {exc}")
    return error_response(500, f"internal error ({type(exc).__name__}); see the server log", "server_error")


HANDLERS = {
    RequestError: on_request_error,
    ValidationError: on_validation_error,
    HTTPException: on_http_error,
    EngineError: on_engine_error,
    StateError: on_state_error,
    Exception: on_unexpected,
}
