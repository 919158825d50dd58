"""The admin API (admin keys only): live configuration (``GET``/``PATCH /v1/admin/config``), pause and
resume training, a checkpoint now, another run's checkpoint taken (``adopt``), a clean stop (checkpoint,
then exit), and the clients seen."""

from __future__ import annotations

import asyncio
import logging

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agentjet_client.protocol import ClientList
from agentjet_server.api.auth import authorize
from agentjet_server.api.context import api_of, read_json_object, runtime_of
from agentjet_server.errors import InvalidRequestError

logger = logging.getLogger(__name__)


async def config(request: Request) -> Response:
    authorize(request, admin=True)
    control = runtime_of(request).control
    if request.method == "PATCH":
        changes = await read_json_object(request)
        current = await asyncio.to_thread(control.change, changes)
    else:
        current = control.config()
    return JSONResponse(current.model_dump(mode="json"))


async def pause(request: Request) -> Response:
    authorize(request, admin=True)
    return JSONResponse((await asyncio.to_thread(runtime_of(request).control.pause, True)).model_dump())


async def resume(request: Request) -> Response:
    authorize(request, admin=True)
    return JSONResponse((await asyncio.to_thread(runtime_of(request).control.pause, False)).model_dump())


async def checkpoint(request: Request) -> Response:
    authorize(request, admin=True)
    return JSONResponse((await asyncio.to_thread(runtime_of(request).control.checkpoint)).model_dump())


async def adopt(request: Request) -> Response:
    authorize(request, admin=True)
    body = await read_json_object(request)
    unknown = sorted(set(body) - {"checkpoint"})
    if unknown:
        what = f"unknown field '{unknown[0]}': the body is {{\"checkpoint\": PATH}}"
        raise InvalidRequestError(what, param=unknown[0])
    info = await asyncio.to_thread(runtime_of(request).control.adopt, body.get("checkpoint", ""))
    return JSONResponse(info.model_dump())


async def stop(request: Request) -> Response:
    authorize(request, admin=True)
    api = api_of(request)
    rt, on_stop = api.runtime, api.on_stop
    if on_stop is None:
        raise InvalidRequestError("this server was not started by `agentjet-server up`; stop its process instead")
    info = await asyncio.to_thread(rt.control.checkpoint) if rt.recovery is not None else None
    version, step = rt.loop.live
    message = f"checkpoint {info.path} written; the server exits" if info else "the server exits"
    logger.warning("admin: stop requested (%s)", message)
    asyncio.get_running_loop().call_later(0.2, on_stop)  # after this answer is sent
    answer = {
        "paused": rt.loop.paused,
        "step": step,
        "policy_version": version,
        "message": message,
        "checkpoint": info.model_dump() if info else None,
    }
    return JSONResponse(answer)


async def clients(request: Request) -> Response:
    authorize(request, admin=True)
    return JSONResponse(ClientList(clients=runtime_of(request).telemetry.clients.list()).model_dump())


ROUTES = [
    Route("/v1/admin/config", config, methods=["GET", "PATCH"]),
    Route("/v1/admin/pause", pause, methods=["POST"]),
    Route("/v1/admin/resume", resume, methods=["POST"]),
    Route("/v1/admin/checkpoint", checkpoint, methods=["POST"]),
    Route("/v1/admin/adopt", adopt, methods=["POST"]),
    Route("/v1/admin/stop", stop, methods=["POST"]),
    Route("/v1/admin/clients", clients, methods=["GET"]),
]
