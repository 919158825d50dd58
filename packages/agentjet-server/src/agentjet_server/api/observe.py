"""What people and scrapers watch: the dashboard page (one self-contained file that reads the API, asking
once for a key when keys are set), its overview and metrics history, and ``/metrics`` for Prometheus."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

from agentjet_server.api.auth import authorize
from agentjet_server.api.context import api_of, int_param, runtime_of
from agentjet_server.errors import InvalidRequestError
from agentjet_server.observe.exposition import CONTENT_TYPE

DASHBOARD = Path(__file__).resolve().parent.parent / "observe" / "dashboard" / "index.html"


def _plain(value: Any) -> Any:
    """A dataclass as JSON-ready data (None stays None)."""
    return dataclasses.asdict(value) if value is not None else None


async def home(request: Request) -> Response:
    return RedirectResponse("/dashboard", status_code=307)


async def dashboard(request: Request) -> Response:
    """The live dashboard page (no key: the page asks for one and sends it with its API calls)."""
    page = DASHBOARD.read_bytes()
    return Response(page, media_type="text/html; charset=utf-8", headers={"Cache-Control": "no-cache"})


async def metrics(request: Request) -> Response:
    authorize(request)
    api = api_of(request)
    if not api.runtime.settings.metrics:
        raise InvalidRequestError("metrics are off on this server (started with --no-metrics)", code="metrics_off")
    return Response(await asyncio.to_thread(api.exposition.render), media_type=CONTENT_TYPE)


async def history(request: Request) -> Response:
    authorize(request)
    telemetry = runtime_of(request).telemetry
    since = int_param(request, "since", 0)
    limit = int_param(request, "limit", 5000)
    kinds = set(request.query_params.get("kind", "").split(",")) - {""} or None
    lines = telemetry.history.since(since, kinds, limit=max(1, limit))
    body = {"lines": lines, "last_seq": telemetry.history.last_seq}
    return Response(json.dumps(body, allow_nan=False), media_type="application/json")


async def overview(request: Request) -> Response:
    """What the dashboard shows besides the history: figures, rewards, clients, recent events."""
    authorize(request)
    rt = runtime_of(request)
    telemetry = rt.telemetry
    body = {
        "status": rt.status().model_dump(),
        "figures": telemetry.figures(rt.snapshot()),
        "rewards": telemetry.rewards(),
        "last_step": _plain(telemetry.last_step),
        "clients": [c.model_dump() for c in telemetry.clients.list()],
        "recent": list(telemetry.recent)[-50:],
        "config": rt.control.config().model_dump(),
    }
    return Response(json.dumps(body, default=str), media_type="application/json")


ROUTES = [
    Route("/", home, methods=["GET"]),
    Route("/dashboard", dashboard, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
    Route("/v1/metrics/history", history, methods=["GET"]),
    Route("/v1/overview", overview, methods=["GET"]),
]
