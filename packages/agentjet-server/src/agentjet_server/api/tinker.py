"""The Tinker API (``/api/v1/...``): the wire protocol of the ``tinker`` SDK (0.38), so training code written
for Tinker (and the tinker-cookbook's loops) trains on this server with only ``base_url`` changed
(docs/tinker.md). Keys: the SDK sends ``X-API-Key: tml-...``; the server strips ``tml-`` and checks the rest
against its keys (any key that starts with ``tml-`` on a server without keys). The work runs on the
workbench's thread (``tinker.service``); most routes answer with a future that ``retrieve_future`` resolves.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agentjet_server.api.context import api_of, int_param, read_json_object, runtime_of
from agentjet_server.errors import AuthenticationError, InvalidRequestError, NotFoundError
from agentjet_server.tinker import wire
from agentjet_server.tinker.service import Service

BODY_LIMIT = 64 * 1024 * 1024


def _authorize(request: Request) -> None:
    key = request.headers.get("x-api-key") or request.headers.get("authorization", "").removeprefix("Bearer ").strip()
    if not key.startswith("tml-"):
        raise AuthenticationError(
            "the Tinker API takes a key that starts with 'tml-' in X-API-Key: TINKER_API_KEY=tml-<your AgentJet key> "
            "(tml-anything on a server without keys)",
            code="invalid_api_key",
        )
    settings = api_of(request).settings
    if not settings.auth_enabled:
        return
    token = key.removeprefix("tml-").encode()
    if not any(hmac.compare_digest(token, k.encode()) for k in [*settings.api_keys, *settings.admin_keys]):
        raise AuthenticationError("the key after 'tml-' is not a key of this server", code="invalid_api_key")


def service_of(request: Request) -> Service:
    _authorize(request)
    return runtime_of(request).tinker


async def _body(request: Request) -> dict[str, Any]:
    return await read_json_object(request, limit=BODY_LIMIT)


def _future(request_id: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"request_id": request_id, **extra})


async def healthz(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def capabilities(request: Request) -> Response:
    service = service_of(request)
    model = {"model_name": service.bench.model_name, "max_context_length": service.max_context}
    return JSONResponse({"supported_models": [{**model, "trainable": True, "sampleable": True}]})


async def client_config(request: Request) -> Response:
    service_of(request)
    # no JWT exchange (the key itself is checked), compressed forward_backward bodies, plain httpx transport
    return JSONResponse({"pjwt_auth_enabled": False, "proto_compress_fwdbwd": True, "use_pyqwest_transport": False})


async def dynamic_config(request: Request) -> Response:
    service_of(request)
    return JSONResponse({"refresh_interval_sec": 300})


async def create_session(request: Request) -> Response:
    service = service_of(request)
    await _body(request)
    return JSONResponse({"type": "create_session", "session_id": service.create_session()})


async def heartbeat(request: Request) -> Response:
    service = service_of(request)
    body = await _body(request)
    service.heartbeat(str(body.get("session_id")))
    return JSONResponse({"type": "session_heartbeat"})


async def finish_session(request: Request) -> Response:
    service = service_of(request)
    service.bench.sessions.beat(request.path_params["session_id"])
    return JSONResponse({})


async def telemetry(request: Request) -> Response:
    service_of(request)
    await request.body()
    return JSONResponse({"status": "accepted"})


async def create_model(request: Request) -> Response:
    service = service_of(request)
    return _future(service.create_model(await _body(request)))


async def get_info(request: Request) -> Response:
    service = service_of(request)
    return JSONResponse(service.info((await _body(request)).get("model_id")))


async def tokenizer(request: Request) -> Response:
    """The model's tokenizer files (its ``tokenizer.json``, configuration and chat template), so a client on
    another machine loads the tokenizer without a hub (``agentjet_client.finetune.tinker.register``)."""
    service = service_of(request)
    return JSONResponse({"model_name": service.bench.model_name, "files": service.bench.tokenizer_files()})


async def unload_model(request: Request) -> Response:
    service = service_of(request)
    return _future(service.unload(str((await _body(request)).get("model_id"))))


async def forward_backward(request: Request) -> Response:
    service = service_of(request)
    body = await request.body()
    if len(body) > BODY_LIMIT:
        raise InvalidRequestError(f"the body is {len(body)} bytes; at most {BODY_LIMIT} are accepted")
    if wire.PROTOBUF in request.headers.get("content-type", ""):
        raw = await asyncio.to_thread(wire.decompress, body, request.headers.get("content-encoding"))
        parsed = await asyncio.to_thread(wire.forward_backward_from_proto, raw)
    else:
        parsed = wire.forward_backward_from_json(json.loads(body or b"{}"))
    return _future(service.forward_backward(parsed), model_id=parsed.model_id)


async def forward(request: Request) -> Response:
    service = service_of(request)
    parsed = wire.forward_backward_from_json(await _body(request))
    parsed.forward_only = True
    return _future(service.forward_backward(parsed), model_id=parsed.model_id)


async def optim_step(request: Request) -> Response:
    service = service_of(request)
    return _future(service.optim_step(await _body(request)))


async def save_weights(request: Request) -> Response:
    service = service_of(request)
    return _future(service.saving.save_weights(await _body(request), sampler=False))


async def save_weights_for_sampler(request: Request) -> Response:
    service = service_of(request)
    return _future(service.saving.save_weights(await _body(request), sampler=True))


async def load_weights(request: Request) -> Response:
    service = service_of(request)
    return _future(service.saving.load_weights(await _body(request)))


async def create_sampling_session(request: Request) -> Response:
    service = service_of(request)
    sampler_id = service.create_sampler(await _body(request))
    return JSONResponse({"type": "create_sampling_session", "sampling_session_id": sampler_id})


async def sampler(request: Request) -> Response:
    return JSONResponse(service_of(request).sampler_info(request.path_params["sampler_id"]))


async def asample(request: Request) -> Response:
    service = service_of(request)
    body = await _body(request)
    request_id, sequence_ids = service.sample(body, wire.sample_ask(body))
    return _future(request_id, sample_sequence_ids=sequence_ids)


async def retrieve_future(request: Request) -> Response:
    service = service_of(request)
    request_id = str((await _body(request)).get("request_id"))
    future = await service.bench.futures.wait(request_id)
    if future is None:
        raise NotFoundError(f"no future {request_id!r} on this server (its result expires a while after it is ready)")
    if not future.done:
        return JSONResponse({"type": "try_again", "request_id": request_id, "queue_state": "active"})
    if future.error is not None:
        return JSONResponse({"error": future.error, "category": future.category})
    return await asyncio.to_thread(wire.render, future.result, wire.PROTOBUF in request.headers.get("accept", ""))


async def cancel_future(request: Request) -> Response:
    service_of(request)
    return JSONResponse({})


async def training_runs(request: Request) -> Response:
    service = service_of(request)
    return JSONResponse(service.saving.training_runs(int_param(request, "limit", 20), int_param(request, "offset", 0)))


async def training_run(request: Request) -> Response:
    return JSONResponse(service_of(request).saving.training_run(request.path_params["model_id"]))


async def checkpoints(request: Request) -> Response:
    service = service_of(request)
    model_id = request.path_params["model_id"]
    service.saving.training_run(model_id)
    return JSONResponse({"checkpoints": service.bench.checkpoints.listing(model_id)})


def _post(path: str, endpoint: Any) -> Route:
    return Route(f"/api/v1/{path}", endpoint, methods=["POST"])


ROUTES = [
    Route("/api/v1/healthz", healthz, methods=["GET"]),
    Route("/api/v1/get_server_capabilities", capabilities, methods=["GET"]),
    _post("client/config", client_config),
    _post("client/dynamic_config", dynamic_config),
    _post("create_session", create_session),
    _post("session_heartbeat", heartbeat),
    _post("sessions/{session_id}/finish", finish_session),
    _post("telemetry", telemetry),
    _post("create_model", create_model),
    _post("get_info", get_info),
    Route("/api/v1/tokenizer", tokenizer, methods=["GET"]),
    _post("unload_model", unload_model),
    _post("forward_backward", forward_backward),
    _post("forward", forward),
    _post("optim_step", optim_step),
    _post("save_weights", save_weights),
    _post("save_weights_for_sampler", save_weights_for_sampler),
    _post("load_weights", load_weights),
    _post("create_sampling_session", create_sampling_session),
    Route("/api/v1/samplers/{sampler_id}", sampler, methods=["GET"]),
    _post("asample", asample),
    _post("retrieve_future", retrieve_future),
    _post("cancel_future", cancel_future),
    Route("/api/v1/training_runs", training_runs, methods=["GET"]),
    Route("/api/v1/training_runs/{model_id}", training_run, methods=["GET"]),
    Route("/api/v1/training_runs/{model_id}/checkpoints", checkpoints, methods=["GET"]),
]
