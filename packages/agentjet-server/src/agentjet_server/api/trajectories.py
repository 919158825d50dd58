"""Trajectories in and out: pushes (``POST /v1/trajectories``, acknowledged once in the log), the recent
ones and one token by token (what ``agentjet-server inspect`` shows), and the server's state for clients
(``/v1/status``) and probes (``/healthz``, no key)."""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agentjet_client.protocol import Health, TrajectoryBatch
from agentjet_server.api.auth import authorize
from agentjet_server.api.context import api_of, int_param, runtime_of
from agentjet_server.errors import ConflictError, NotFoundError, StateError
from agentjet_server.ingest.bodies import read_model
from agentjet_server.observe.inspection import find_trajectory, trajectory_view


async def healthz(request: Request) -> Response:
    return JSONResponse(Health(policy_version=runtime_of(request).version).model_dump())


async def status(request: Request) -> Response:
    authorize(request)
    return JSONResponse(runtime_of(request).status().model_dump())


async def push(request: Request) -> Response:
    authorize(request)
    api = api_of(request)
    if api.settings.serve_only:
        raise ConflictError(
            "this server runs with --serve-only: it serves its model and trains nothing; push trajectories "
            "to a training server (agentjet-server up without --serve-only)"
        )
    limit, timeout = api.settings.max_body_bytes, api.settings.body_timeout_s
    batch = await read_model(request, TrajectoryBatch, limit, timeout, api.gate, api.large)
    # the answer waits for the log's fsync; a thread keeps that off the event loop
    result = await asyncio.to_thread(api.runtime.ingest, batch)
    return JSONResponse(result.model_dump())


async def recent(request: Request) -> Response:
    authorize(request)
    limit = max(1, min(int_param(request, "limit", 100), 1000))
    return JSONResponse({"trajectories": runtime_of(request).recent.newest(limit)})


async def trajectory(request: Request) -> Response:
    """One trajectory token by token (what ``agentjet-server inspect`` shows)."""
    authorize(request)
    rt = runtime_of(request)
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
        return trajectory_view(found, rt.engine.tokenizer, rt.signer)

    return JSONResponse(await asyncio.to_thread(view))


ROUTES = [
    Route("/healthz", healthz, methods=["GET"]),
    Route("/v1/status", status, methods=["GET"]),
    Route("/v1/trajectories", push, methods=["POST"]),
    Route("/v1/trajectories", recent, methods=["GET"]),
    Route("/v1/trajectories/{trajectory_id:str}", trajectory, methods=["GET"]),
]
