"""The server's part of a swarm's traces (``agentjet_client.tracing`` has the rest).

- ``TracingMiddleware``: each API request is a server span under the trace its headers carry
  (``traceparent``; the client's ``chat`` span); the episode id in the ``baggage`` header goes on the
  request's log lines (``--log-format json``).
- ``record_ingest``: an ``ingest`` span per pushed trajectory, under its episode's span (the
  trajectory's ``traceparent``), with its answer.
- ``step_links``: the links of a ``learner step`` span, one to each trajectory it trained.

All of it records nothing unless a tracer provider is configured (``OTEL_*`` variables).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from agentjet_client import tracing
from agentjet_client.logs import log_context
from agentjet_client.protocol import Trajectory, TrajectoryResult

TRACED = ("/v1/",)  # what is traced: the API (not the dashboard's files, not /healthz)
CARRIERS = (b"traceparent", b"baggage")  # the headers that carry a trace or an episode's id


class TracingMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not tracing.enabled() or not path.startswith(TRACED):
            await self.app(scope, receive, send)
            return
        raw = scope.get("headers", [])
        if tracing.tracer("agentjet") is None and not any(k in CARRIERS for k, _ in raw):
            await self.app(scope, receive, send)  # no span to record and no episode id for the log lines
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in raw}
        parent = tracing.extract(headers)
        status = {"code": 0}

        async def sending(message: Any) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        name = f"{scope.get('method', 'GET')} {path}"
        attributes = {"http.request.method": scope.get("method", "GET"), "url.path": path}
        with (
            tracing.span(name, parent=parent, kind="server", attributes=attributes) as span,
            log_context(episode_id=tracing.episode_of(parent)),
        ):
            await self.app(scope, receive, sending)
            if span is not None:
                span.set_attribute("http.response.status_code", status["code"])


def record_ingest(trajectories: Sequence[Trajectory], results: Sequence[TrajectoryResult], started: float) -> None:
    """An ``ingest`` span per trajectory that carries its episode's trace, from ``started`` (``time.time()``)."""
    tracer = tracing.tracer("agentjet")
    if tracer is None:
        return
    start_ns, end_ns = int(started * 1e9), time.time_ns()
    for trajectory, result in zip(trajectories, results, strict=True):
        if not trajectory.traceparent:
            continue
        parent = tracing.extract({"traceparent": trajectory.traceparent})
        attributes = {"agentjet.trajectory_id": trajectory.id, "agentjet.answer": result.status}
        span = tracer.start_span("ingest", context=parent, start_time=start_ns, attributes=attributes)
        span.end(end_time=end_ns)


def step_links(groups: Sequence[Sequence[Trajectory]]) -> list[Any]:
    """Links to the episode span of each trajectory in a batch (those that carry one)."""
    links = []
    for group in groups:
        for trajectory in group:
            link = tracing.link_to(trajectory.traceparent, {"agentjet.trajectory_id": trajectory.id})
            if link is not None:
                links.append(link)
    return links
