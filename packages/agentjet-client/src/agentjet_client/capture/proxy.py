"""The loopback capture proxy: a base URL any program in any language can call.

``http://127.0.0.1:PORT/episodes/<episode id>/<agent>/v1`` forwards every request to the ``/v1``
of the agent's server (``SwarmClient.server_for``) and records its sampling calls (chat
completions, Responses, Messages, text completions) into that episode as that agent;
``http://127.0.0.1:PORT/untrained/<agent>/v1`` forwards the same way and records nothing. An
Anthropic SDK takes ``.../episodes/<id>/<agent>`` as its base URL (it adds the ``/v1``). It runs on its
own thread and event loop, started on first use by ``SwarmClient``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx2
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from agentjet_client import tracing
from agentjet_client.capture.recorder import (
    EpisodeRecorder,
    SSECollector,
    api_of,
    chat_form,
    parse_request_body,
    with_claim,
)

logger = logging.getLogger(__name__)

# headers of one hop, not passed on (the client sets its own length, encoding and key)
HOP_HEADERS = {
    "host",
    "content-length",
    "connection",
    "keep-alive",
    "transfer-encoding",
    "authorization",
    "accept-encoding",
}


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": "proxy_error", "param": None, "code": None}}, status_code=status
    )


class CaptureProxy:
    """Forwards ``/episodes/{id}/{agent}/v1/...`` to the agent's server (``upstream(agent)``, a
    base URL) and records chat calls."""

    def __init__(
        self,
        upstream: Callable[[str], str],
        lookup: Callable[[str], EpisodeRecorder | None],
        api_key: str | None = None,
        transport: httpx2.AsyncBaseTransport | None = None,
    ) -> None:
        self.upstream = upstream
        self.lookup = lookup
        self.api_key = api_key
        self._transport = transport
        self._client: httpx2.AsyncClient | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.port = 0
        self.app = Starlette(
            routes=[
                Route("/episodes/{episode}/{agent}/v1/{path:path}", self._forward, methods=["GET", "POST"]),
                Route("/untrained/{agent}/v1/{path:path}", self._forward, methods=["GET", "POST"]),
                Route("/episodes/{episode}/turn_reward", self._turn_reward, methods=["POST"]),
            ],
            lifespan=self._lifespan,
        )

    @asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        yield
        if self._client is not None:
            await self._client.aclose()

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url_for(self, episode_id: str, agent: str) -> str:
        return f"{self.base}/episodes/{episode_id}/{agent}/v1"

    def start(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", lifespan="on", timeout_keep_alive=30)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, name="agentjet-proxy", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the capture proxy did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _http(self) -> httpx2.AsyncClient:
        if self._client is None:
            self._client = httpx2.AsyncClient(transport=self._transport, timeout=httpx2.Timeout(600.0, connect=10.0))
        return self._client

    async def _turn_reward(self, request: Request) -> Response:
        """``{"reward": x, "agent": name or null}``: ``Episode.reward_turn`` for an agent in a worker process."""
        recorder = self.lookup(request.path_params["episode"])
        if recorder is None:
            return _error(404, f"episode '{request.path_params['episode']}' is not open in this client")
        try:
            body = json.loads(await request.body())
            if not isinstance(body, dict) or "reward" not in body:
                raise ValueError('send {"reward": <number>, "agent": <name or null>}')
            recorder.reward_turn(body["reward"], body.get("agent"))
        except ValueError as exc:
            return _error(400, str(exc))
        return JSONResponse({"ok": True})

    async def _forward(self, request: Request) -> Response:
        """Forward to the agent's server; under ``/episodes/{id}/...`` record the call into that episode,
        under ``/untrained/...`` (``episode.openai(train=False)`` in a worker) record nothing."""
        episode = request.path_params.get("episode")
        agent = request.path_params["agent"]
        recorder = self.lookup(episode) if episode is not None else None
        if recorder is None and episode is not None:
            return _error(404, f"episode '{episode}' is not open in this client; use the base_url of a live episode")
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        if self.api_key:
            headers["authorization"] = f"Bearer {self.api_key}"
        elif "authorization" in request.headers:
            headers["authorization"] = request.headers["authorization"]
        server = self.upstream(agent)
        url = f"{server}/v1/{request.path_params['path']}"
        api = api_of(request.method, url) if recorder is not None else None
        chat = chat_form(api, parse_request_body(body)) if api is not None else None
        capture = recorder is not None and api is not None and chat is not None
        started = time.time()
        sent = with_claim(body, recorder.extension(agent, chat)) if recorder is not None and chat is not None else body
        headers.pop("content-length", None)
        # the call's span: under its episode's (the proxy's loop runs in a thread of its own), else under
        # whatever trace the caller's headers carry
        parent = recorder.trace if recorder is not None else tracing.extract(request.headers)
        try:
            with tracing.span("chat", parent=parent, kind="client", attributes={"agentjet.agent": agent}):
                tracing.inject(headers)
                upstream_request = self._http().build_request(
                    request.method, url, content=sent, headers=headers, params=request.query_params
                )
                upstream = await self._http().send(upstream_request, stream=True)
        except httpx2.HTTPError as exc:
            return _error(502, f"could not reach the AgentJet server of agent '{agent}' at {server}: {exc}")
        out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_HEADERS | {"content-encoding"}}
        if "text/event-stream" in upstream.headers.get("content-type", "") and upstream.status_code == 200:
            relay = (
                self._relay(upstream, agent, recorder, chat, started, api)
                if capture and recorder is not None
                else self._pass(upstream)
            )
            return StreamingResponse(relay, status_code=200, headers=out_headers)
        data = await upstream.aread()
        await upstream.aclose()
        if capture and recorder is not None and upstream.status_code == 200:
            try:
                parsed: Any = json.loads(data)
            except ValueError:
                parsed = None
            assert chat is not None and api is not None
            recorder.record_response(agent, chat, parsed, started, api)
        return Response(data, status_code=upstream.status_code, headers=out_headers)

    async def _pass(self, upstream: httpx2.Response) -> AsyncIterator[bytes]:
        try:
            async for chunk in upstream.aiter_bytes():
                yield chunk
        finally:
            await upstream.aclose()

    async def _relay(
        self,
        upstream: httpx2.Response,
        agent: str,
        recorder: EpisodeRecorder,
        chat: dict[str, Any] | None,
        started: float,
        api: str | None,
    ) -> AsyncIterator[bytes]:
        collector = SSECollector()
        try:
            async for chunk in upstream.aiter_bytes():
                collector.feed(chunk)
                yield chunk
        except (httpx2.HTTPError, asyncio.CancelledError) as exc:
            recorder.fail(f"stream interrupted: {type(exc).__name__}")
            raise
        finally:
            await upstream.aclose()
        if chat is not None and api is not None:
            recorder.record_chunks(agent, chat, collector.chunks, started, api)
