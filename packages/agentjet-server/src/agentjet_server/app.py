"""HTTP routes: thin glue from Starlette requests to ``SwarmRuntime`` calls.

Every non-2xx answer is OpenAI's error shape, chosen by exception class: the caller's mistakes
(``RequestError`` and pydantic validation errors) are 4xx with a message that says what is
wrong and how to fix it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Route

from agentjet_client.dialects import DialectError, messages_to_chat, responses_to_chat
from agentjet_client.protocol import (
    ChatCompletionRequest,
    ClientList,
    CompletionRequest,
    ErrorDetail,
    ErrorResponse,
    Health,
    ModelCard,
    ModelList,
    TrajectoryBatch,
)
from agentjet_server.bodies import LARGE_IN_FLIGHT, describe_validation_error, parse_json, read_body, read_model
from agentjet_server.body_gate import BodyGate
from agentjet_server.engine.base import Engine
from agentjet_server.errors import (
    AuthenticationError,
    EngineError,
    InvalidRequestError,
    NotFoundError,
    PermissionDeniedError,
    RateLimitError,
    RequestError,
    StateError,
)
from agentjet_server.exposition import CONTENT_TYPE, Exposition
from agentjet_server.inspection import find_trajectory, trajectory_view
from agentjet_server.runtime import SwarmRuntime
from agentjet_server.serving import dialects as apis
from agentjet_server.settings import ServerSettings

logger = logging.getLogger(__name__)
T = TypeVar("T")
WORKER_THREADS = "agentjet-server-worker"
DASHBOARD = Path(__file__).parent / "dashboard" / "index.html"


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


def _int_param(request: Request, name: str, default: int) -> int:
    value = request.query_params.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise InvalidRequestError(
            f"query parameter '{name}' must be an integer (got {value[:40]!r})", param=name
        ) from None


def _plain(value: Any) -> Any:
    """A dataclass as JSON-ready data (None stays None)."""
    return dataclasses.asdict(value) if value is not None else None


async def read_json_object(request: Request, limit: int = 64 * 1024) -> dict[str, Any]:
    """A small JSON object body (the admin API's), or a 400 that says what is wrong."""
    body = await request.body()
    if len(body) > limit:
        raise InvalidRequestError(f"the body is {len(body)} bytes; at most {limit} are accepted here")
    try:
        value = json.loads(body or b"{}")
    except ValueError as exc:
        raise InvalidRequestError(f"the body is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise InvalidRequestError('the body must be a JSON object, e.g. {"lr": 0.0005}')
    return value


def _key_in(token: str, keys: Sequence[str]) -> bool:
    return any(hmac.compare_digest(token.encode(), k.encode()) for k in keys)


def create_app(
    engine: Engine,
    settings: ServerSettings,
    runtime: SwarmRuntime | None = None,
    model_path: str | None = None,
    on_stop: Callable[[], None] | None = None,
) -> Starlette:
    """The ASGI app. ``runtime`` defaults to a new one over ``engine`` (its learner starts now).
    ``on_stop`` ends the process's HTTP server (``POST /v1/admin/stop``); without it, stop is refused."""
    rt = runtime or SwarmRuntime.create(engine, settings, model_path or str(engine.model_path))
    gate = BodyGate()  # judges large bodies in a process of its own (started on first use)
    large = asyncio.Semaphore(LARGE_IN_FLIGHT)
    exposition = Exposition(rt.telemetry, rt.snapshot)

    def authorize(request: Request, admin: bool = False) -> None:
        """Any key when keys are set (client keys infer, push and read; admin keys also steer)."""
        if not settings.auth_enabled:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:  # Anthropic's SDK sends its key as x-api-key
            scheme, token = "bearer", request.headers.get("x-api-key", "")
        if not token:
            raise AuthenticationError("missing API key: send 'Authorization: Bearer <key>'", code="missing_api_key")
        token = token.strip()
        if _key_in(token, settings.admin_keys):
            return
        if not _key_in(token, settings.api_keys):
            raise AuthenticationError("the API key is not valid for this server", code="invalid_api_key")
        if admin:
            raise PermissionDeniedError(
                f"{request.url.path} needs an admin key; this is a client key (client keys can infer, push "
                "trajectories and read status and metrics). Use a key from AGENTJET_ADMIN_KEYS or --admin-key-file",
                code="admin_key_required",
            )

    async def dashboard(request: Request) -> Response:
        """The live dashboard: one self-contained page that reads the API below (the key it needs,
        when keys are set, is asked for once and kept by the browser)."""
        page = DASHBOARD.read_bytes()
        return Response(page, media_type="text/html; charset=utf-8", headers={"Cache-Control": "no-cache"})

    async def home(request: Request) -> Response:
        return RedirectResponse("/dashboard", status_code=307)

    async def healthz(request: Request) -> Response:
        return JSONResponse(Health(policy_version=rt.version).model_dump())

    async def models(request: Request) -> Response:
        authorize(request)
        card = ModelCard(id=rt.engine.model_name, created=int(rt.started))
        return JSONResponse(ModelList(data=[card]).model_dump())

    def check_model(body: ChatCompletionRequest | CompletionRequest) -> None:
        # a call that comes through an AgentJet client's capture (it carries the ``agentjet``
        # extension) was routed here for its agent: agent code written for another model name
        # (``gpt-4o-mini``) trains unchanged, and its turn records both names
        if body.agentjet is None and body.model not in (None, "", rt.engine.model_name, "default"):
            raise InvalidRequestError(
                f"model '{body.model}' is not served here; this server serves '{rt.engine.model_name}' "
                "(see GET /v1/models)",
                param="model",
                code="model_not_found",
            )

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

    def chat_error(message: str, error_type: str) -> str:
        return error_frame(message, error_type) + "data: [DONE]\n\n"

    async def whole(
        request: Request, body: ChatCompletionRequest, shape: Callable[[Any], Any] | None = None
    ) -> Response:
        completion = await _unless_disconnected(request, rt.chat.complete(body, rt.engine.model_name))
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

    async def chat_completions(request: Request) -> Response:
        authorize(request)
        body = await read_model(
            request, ChatCompletionRequest, settings.max_chat_body_bytes, settings.body_timeout_s, gate, large
        )
        check_model(body)
        if body.stream:
            return await streamed(request, rt.chat.stream(body, rt.engine.model_name), chat_error)
        return await whole(request, body)

    async def completions(request: Request) -> Response:
        """Text completions (no chat template), as vLLM's server serves them."""
        authorize(request)
        body = await read_model(
            request, CompletionRequest, settings.max_chat_body_bytes, settings.body_timeout_s, gate, large
        )
        check_model(body)
        if body.stream:
            return await streamed(request, rt.text.stream(body, rt.engine.model_name), chat_error)
        completion = await _unless_disconnected(request, rt.text.complete(body, rt.engine.model_name))
        if completion is None:  # nobody is waiting for it any more
            return Response(status_code=499)
        text = await asyncio.to_thread(completion.model_dump_json, exclude_none=True)
        return Response(text, media_type="application/json")

    async def dialect_request(
        request: Request, to_chat: Callable[[dict[str, Any]], dict[str, Any]]
    ) -> tuple[dict[str, Any], ChatCompletionRequest]:
        """The request body and the chat request it means (one choice, streamed or not)."""
        raw = await read_body(request, settings.max_chat_body_bytes, settings.body_timeout_s)
        data = await asyncio.to_thread(parse_json, raw) if len(raw) > 1 << 16 else parse_json(raw)
        try:
            chat = to_chat(data)
        except DialectError as exc:
            raise InvalidRequestError(exc.message, param=exc.param) from None
        body = ChatCompletionRequest.model_validate({**chat, "stream": bool(data.get("stream"))})
        check_model(body)
        return data, body

    async def responses(request: Request) -> Response:
        """OpenAI's Responses API, stateless: the answer as output items, events when streamed."""
        authorize(request)
        data, body = await dialect_request(request, responses_to_chat)
        if body.stream:

            def failed(message: str, error_type: str) -> str:
                return apis.response_error_event(message, error_type)

            return await streamed(
                request, apis.response_events(rt.chat.stream_chunks(body, rt.engine.model_name), data), failed
            )
        return await whole(request, body, lambda completion: apis.response_object(completion, data))

    async def messages(request: Request) -> Response:
        """Anthropic's Messages API: the answer as content blocks, events when streamed."""
        authorize(request)
        data, body = await dialect_request(request, messages_to_chat)
        decode = rt.engine.decode
        if body.stream:
            events = apis.message_events(rt.chat.stream_chunks(body, rt.engine.model_name), data, decode)
            return await streamed(request, events, apis.message_error_event)
        return await whole(request, body, lambda completion: apis.message_object(completion, data, decode))

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

    async def metrics(request: Request) -> Response:
        authorize(request)
        if not rt.settings.metrics:
            raise InvalidRequestError("metrics are off on this server (started with --no-metrics)", code="metrics_off")
        return Response(await asyncio.to_thread(exposition.render), media_type=CONTENT_TYPE)

    async def history(request: Request) -> Response:
        authorize(request)
        since = _int_param(request, "since", 0)
        limit = _int_param(request, "limit", 5000)
        kinds = set(request.query_params.get("kind", "").split(",")) - {""} or None
        lines = rt.telemetry.history.since(since, kinds, limit=max(1, limit))
        body = {"lines": lines, "last_seq": rt.telemetry.history.last_seq}
        return Response(json.dumps(body, allow_nan=False), media_type="application/json")

    async def overview(request: Request) -> Response:
        """What the dashboard shows besides the history: figures, rewards, clients, recent events."""
        authorize(request)
        snapshot = rt.snapshot()
        body = {
            "status": rt.status().model_dump(),
            "figures": rt.telemetry.figures(snapshot),
            "rewards": rt.telemetry.rewards(),
            "last_step": _plain(rt.telemetry.last_step),
            "clients": [c.model_dump() for c in rt.telemetry.clients.list()],
            "recent": list(rt.telemetry.recent)[-50:],
            "config": rt.control.config().model_dump(),
        }
        return Response(json.dumps(body, default=str), media_type="application/json")

    # -- the admin API ----------------------------------------------------------------------------
    async def admin_config(request: Request) -> Response:
        authorize(request, admin=True)
        if request.method == "PATCH":
            changes = await read_json_object(request)
            config = await asyncio.to_thread(rt.control.change, changes)
        else:
            config = rt.control.config()
        return JSONResponse(config.model_dump(mode="json"))

    async def admin_pause(request: Request) -> Response:
        authorize(request, admin=True)
        return JSONResponse((await asyncio.to_thread(rt.control.pause, True)).model_dump())

    async def admin_resume(request: Request) -> Response:
        authorize(request, admin=True)
        return JSONResponse((await asyncio.to_thread(rt.control.pause, False)).model_dump())

    async def admin_checkpoint(request: Request) -> Response:
        authorize(request, admin=True)
        return JSONResponse((await asyncio.to_thread(rt.control.checkpoint)).model_dump())

    async def admin_stop(request: Request) -> Response:
        authorize(request, admin=True)
        if on_stop is None:
            raise InvalidRequestError("this server was not started by `agentjet-server up`; stop its process instead")
        info = await asyncio.to_thread(rt.control.checkpoint) if rt.recovery is not None else None
        version, step = rt.loop.live
        message = f"checkpoint {info.path} written; the server exits" if info else "the server exits"
        logger.warning("admin: stop requested (%s)", message)
        asyncio.get_running_loop().call_later(0.2, on_stop)  # after this answer is sent
        return JSONResponse(
            {
                "paused": rt.loop.paused,
                "step": step,
                "policy_version": version,
                "message": message,
                "checkpoint": info.model_dump() if info else None,
            }
        )

    async def admin_clients(request: Request) -> Response:
        authorize(request, admin=True)
        return JSONResponse(ClientList(clients=rt.telemetry.clients.list()).model_dump())

    async def recent_trajectories(request: Request) -> Response:
        authorize(request)
        limit = max(1, min(_int_param(request, "limit", 100), 1000))
        return JSONResponse({"trajectories": rt.recent.newest(limit)})

    async def trajectory(request: Request) -> Response:
        """One trajectory token by token (what ``agentjet-server inspect`` shows)."""
        authorize(request)
        trajectory_id = request.path_params["trajectory_id"]

        def view() -> dict[str, Any]:
            found = rt.recent.get(trajectory_id)
            if found is None:
                if rt.state is None:
                    raise NotFoundError(f"no trajectory {trajectory_id} on this server")
                try:
                    found = find_trajectory(rt.state.root, trajectory_id)
                except StateError as exc:
                    raise NotFoundError(str(exc)) from exc
            engine: Any = rt.engine  # every engine holds its chat tokenizer (``engine.tokens``)
            return trajectory_view(found, engine.tokenizer, rt.signer)

        return JSONResponse(await asyncio.to_thread(view))

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
            404: (
                f"no route {request.url.path}; see /v1/models, /v1/chat/completions, /v1/responses, /v1/messages, "
                "/v1/completions, /v1/trajectories, "
                "/v1/status, /metrics, /dashboard, /v1/admin/... (docs/protocol.md)"
            ),
            405: f"method {request.method} is not allowed on {request.url.path}",
        }.get(exc.status_code, str(exc.detail))
        return error_response(
            exc.status_code, hint, "invalid_request_error" if exc.status_code < 500 else "server_error"
        )

    async def on_engine_error(request: Request, exc: Exception) -> Response:
        logger.error("engine error on %s: %s", request.url.path, exc)
        rt.telemetry.record_event("engine", f"{request.url.path}: {exc}")
        return error_response(500, str(exc), "engine_error")

    async def on_state_error(request: Request, exc: Exception) -> Response:
        # nothing was acknowledged: the client keeps the batch and retries
        logger.error("state error on %s: %s", request.url.path, exc)
        rt.telemetry.record_event("state", f"{request.url.path}: {exc} (answered 503)")
        return error_response(503, f"{exc}; nothing in this request was acknowledged, retry later", "server_error")

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        logger.exception("unexpected error on %s", request.url.path)
        rt.telemetry.record_event("internal", f"{request.url.path}: {type(exc).__name__}: {exc}")
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
            Route("/", home, methods=["GET"]),
            Route("/dashboard", dashboard, methods=["GET"]),
            Route("/healthz", healthz, methods=["GET"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/responses", responses, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/messages", messages, methods=["POST"]),
            Route("/v1/trajectories", trajectories, methods=["POST"]),
            Route("/v1/trajectories", recent_trajectories, methods=["GET"]),
            Route("/v1/trajectories/{trajectory_id:str}", trajectory, methods=["GET"]),
            Route("/v1/status", status, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/v1/metrics/history", history, methods=["GET"]),
            Route("/v1/overview", overview, methods=["GET"]),
            Route("/v1/admin/config", admin_config, methods=["GET", "PATCH"]),
            Route("/v1/admin/pause", admin_pause, methods=["POST"]),
            Route("/v1/admin/resume", admin_resume, methods=["POST"]),
            Route("/v1/admin/checkpoint", admin_checkpoint, methods=["POST"]),
            Route("/v1/admin/stop", admin_stop, methods=["POST"]),
            Route("/v1/admin/clients", admin_clients, methods=["GET"]),
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
