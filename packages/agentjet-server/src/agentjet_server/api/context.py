"""What every route shares, kept on ``app.state.api``: the runtime, its settings, the body gate."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from agentjet_server.errors import InvalidRequestError
from agentjet_server.ingest.bodies import LARGE_IN_FLIGHT
from agentjet_server.ingest.body_gate import BodyGate
from agentjet_server.observe.exposition import Exposition
from agentjet_server.runtime import SwarmRuntime
from agentjet_server.settings import ServerSettings


@dataclass
class Api:
    runtime: SwarmRuntime
    settings: ServerSettings  # as the app was created with: keys, body limits and timeouts
    on_stop: Callable[[], None] | None = None  # ends the process's HTTP server (``POST /v1/admin/stop``)
    gate: BodyGate = field(default_factory=BodyGate)  # judges large bodies in a process of its own
    large: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(LARGE_IN_FLIGHT))
    exposition: Exposition = field(init=False)  # ``/metrics``, over the runtime's telemetry

    def __post_init__(self) -> None:
        self.exposition = Exposition(self.runtime.telemetry, self.runtime.snapshot)


def api_of(request: Request) -> Api:
    api: Api = request.app.state.api
    return api


def runtime_of(request: Request) -> SwarmRuntime:
    return api_of(request).runtime


def int_param(request: Request, name: str, default: int) -> int:
    value = request.query_params.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise InvalidRequestError(
            f"query parameter '{name}' must be an integer (got {value[:40]!r})", param=name
        ) from None


async def read_json_object(request: Request, limit: int = 64 * 1024) -> dict[str, Any]:
    """A small JSON object body (the admin API's), or a 400 that says what is wrong. A body that is empty
    or only whitespace is read as ``{}``."""
    body = await request.body()
    if len(body) > limit:
        raise InvalidRequestError(f"the body is {len(body)} bytes; at most {limit} are accepted here")
    try:
        value = json.loads(body if body.strip() else b"{}")
    except ValueError as exc:
        raise InvalidRequestError(f"the body is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise InvalidRequestError('the body must be a JSON object, e.g. {"lr": 0.0005}')
    return value
