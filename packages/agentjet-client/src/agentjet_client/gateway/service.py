"""The gateway process: the front door, the session book, the spools and their senders, on one event loop.

    gateway = Gateway(GatewayConfig(server="http://127.0.0.1:8000", spool_dir=Path("gw")))
    gateway.serve("127.0.0.1", 8100)

Routes: every ``/v1/...`` route of the server (``forward``; ``/agents/NAME/v1/...`` or the
``X-AgentJet-Agent`` header names the agent, whose server ``--server NAME=URL`` gives), and

- ``POST /v1/feedback`` — a session's reward (``protocol.Feedback``): it ends the session and pushes it;
- ``POST /v1/sessions/{session}/close`` — no more calls join it; it waits for its feedback;
- ``GET /v1/sessions/{session}`` — its calls and, with ``--fan-out``, its candidates' answers;
- ``GET /v1/gateway/status`` — the counts (``protocol.GatewayStatus``); ``GET /healthz``.

At start it reads back what the journal kept (open sessions, finished ones not yet spooled); every
``sweep_s`` it ends idle sessions and expires unrewarded ones; every few seconds it reads the default
server's status (its GRPO group size; whether it answers).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agentjet_client.client import SwarmClient
from agentjet_client.delivery.sender import DeliveryCounts, Sender
from agentjet_client.delivery.spool import Spool, spool_key
from agentjet_client.errors import AgentJetError
from agentjet_client.gateway.episodes import FeedbackError
from agentjet_client.gateway.forward import AGENT_HEADER, Forwarder, error
from agentjet_client.gateway.journal import Journal
from agentjet_client.gateway.judge import SessionJudge
from agentjet_client.gateway.sessions import SessionBook
from agentjet_client.protocol import (
    ClientReport,
    Feedback,
    GatewayCounts,
    GatewayStatus,
    Trajectory,
    check_agent_name,
)
from agentjet_client.tasks.judges import Judge

logger = logging.getLogger(__name__)

DEFAULT_LABELS = {"up": 1.0, "down": 0.0, "thumbs_up": 1.0, "thumbs_down": 0.0, "good": 1.0, "bad": 0.0}


@dataclass
class GatewayConfig:
    server: str
    spool_dir: Path
    agents: dict[str, str] = field(default_factory=dict)  # agent -> its server
    api_key: str | None = None
    idle_s: float = 600.0
    ttl_s: float = 6 * 3600.0
    fan_out: int = 0
    opt_in: bool = False
    redact: Callable[[str], str] | None = None
    fallback: str | None = None
    labels: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_LABELS))
    group_by: str = "prompt"
    task_tag: str | None = None
    judge: Judge | None = None  # rewards the sessions that get no feedback (``gateway.judge``)
    judge_after_s: float = 0.0
    sweep_s: float = 1.0
    status_s: float = 5.0


def describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors(include_url=False)[:3]:
        loc = ".".join(str(x) for x in err["loc"]) or "body"
        what = "unknown field" if err["type"] == "extra_forbidden" else str(err["msg"]).removeprefix("Value error, ")
        parts.append(f"{loc}: {what}")
    return "invalid feedback: " + "; ".join(parts)


class Gateway:
    """One gateway (see the module docstring)."""

    def __init__(self, config: GatewayConfig, progress: Callable[[str], None] | None = None) -> None:
        if config.fan_out == 1 or config.fan_out < 0:
            raise ValueError("--fan-out samples a call N times for N >= 2 (0 turns it off)")
        if config.ttl_s < config.idle_s:
            raise ValueError(f"--ttl ({config.ttl_s:g} s) must be at least --idle ({config.idle_s:g} s)")
        self.config = config
        self.client = SwarmClient(config.server, config.api_key, agents=config.agents)
        self.journal = Journal(config.spool_dir)
        self.group_size = 1
        self.book = SessionBook(
            self.journal,
            idle_s=config.idle_s,
            ttl_s=config.ttl_s,
            group_size=lambda: self.group_size,
            labels=config.labels,
            group_by=config.group_by,
            task_tag=config.task_tag,
        )
        self.forwarder = Forwarder(
            self.book,
            self.client.server_for,
            api_key=config.api_key,
            fan_out=config.fan_out,
            opt_in=config.opt_in,
            redact=config.redact,
            fallback=config.fallback,
        )
        self.judging = SessionJudge(config.judge, self.book, config.judge_after_s) if config.judge else None
        self.answers = DeliveryCounts()
        self.senders = {
            server: Sender(
                self.client,
                server,
                Spool(config.spool_dir / "spool" / spool_key(server)),
                self.answers,
                self._client_report,
            )
            for server in self.client.servers
        }
        self.app = Starlette(
            routes=[
                Route("/healthz", self._healthz, methods=["GET"]),
                Route("/v1/feedback", self._feedback, methods=["POST"]),
                Route("/v1/sessions/{session}/close", self._close, methods=["POST"]),
                Route("/v1/sessions/{session}", self._session, methods=["GET"]),
                Route("/v1/gateway/status", self._status, methods=["GET"]),
                Route("/agents/{agent}/v1/{path:path}", self._forward, methods=["GET", "POST"]),
                Route("/v1/{path:path}", self._forward, methods=["GET", "POST"]),
            ],
            lifespan=self._lifespan,
        )
        self._tasks: list[asyncio.Task[Any]] = []
        self._progress = progress

    # ------------------------------------------------------------------ lifecycle

    @asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        restored = await asyncio.to_thread(self.book.restore)
        if restored:
            logger.info("gateway: %d sessions read back from %s", restored, self.journal.path)
        self._tasks = [asyncio.create_task(sender.run()) for sender in self.senders.values()]
        for session, made in await asyncio.to_thread(self.journal.unspooled):
            await self._spool(session, made)
        self._tasks += [asyncio.create_task(self._sweep()), asyncio.create_task(self._watch_server())]
        if self.judging is not None:
            self._tasks.append(asyncio.create_task(self._judge(self.judging)))
        if self._progress is not None:
            self._tasks.append(asyncio.create_task(self._report_progress(self._progress)))
        try:
            yield
        finally:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            if self.judging is not None:
                await self.judging.aclose()
            await self.forwarder.aclose()
            await self.client.aclose_pool()
            for sender in self.senders.values():
                sender.spool.close()
            self.client.close()
            self.journal.close()

    def serve(self, host: str, port: int, **uvicorn_options: Any) -> None:
        uvicorn.run(self.app, host=host, port=port, log_level="warning", timeout_keep_alive=30, **uvicorn_options)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self.config.sweep_s)
            try:
                _, expired = await asyncio.to_thread(self.book.sweep)
                if expired:
                    logger.info("gateway: %d sessions expired without a reward (--ttl)", expired)
                await asyncio.to_thread(self.journal.forget_finished, time.time() - 24 * 3600)
            except Exception:  # a failed sweep is tried again next time; the gateway keeps serving
                logger.exception("gateway: sweeping sessions failed")

    async def _judge(self, judging: SessionJudge) -> None:
        while True:
            await asyncio.sleep(self.config.sweep_s)
            judging.start(self._judged)

    async def _judged(self, feedback: Feedback) -> None:
        result, made = await asyncio.to_thread(self.book.finish, feedback, True)
        if made:
            await self._spool(result.session, made)

    async def _watch_server(self) -> None:
        answered = True
        while True:
            try:
                status = await asyncio.to_thread(self.client.status, None, False)
                self.group_size = status.learner.group_size
                if not answered:  # back: what waits in the spool goes now, not at the end of a backoff
                    self.senders[self.client.server_url].answering()
                self.forwarder.reachable = answered = True
            except AgentJetError:
                self.forwarder.reachable = answered = False
            await asyncio.sleep(self.config.status_s)

    async def _report_progress(self, say: Callable[[str], None], every: float = 10.0) -> None:
        """A line of counts every ``every`` seconds while they change."""
        last = ""
        while True:
            await asyncio.sleep(every)
            c = await asyncio.to_thread(self.journal.counts)
            judged = f" ({c['judged']} judged)" if self.judging is not None else ""
            line = (
                f"sessions {c['sessions']}: {c['open']} open, {c['waiting']} waiting for feedback, {c['trained']} "
                f"trained{judged}, {c['expired']} expired, {c['opted_out']} opted out, {c['fallback']} fallback; calls "
                f"{c['calls']}; server answered {self.answers.accepted} accepted, {self.answers.rejected} rejected"
                + ("" if self.forwarder.reachable else "; the server is not answering")
            )
            if line != last:
                say(line)
                last = line

    def _client_report(self, spool: Spool, count: int) -> ClientReport:
        counts = self.journal.counts()
        return ClientReport(
            id=self.book.gateway_id, spool_depth=spool.depth, episodes=counts["trained"], running=self.book.live
        )

    async def _spool(self, session: str, made: list[Trajectory]) -> None:
        """Put a finished session's trajectories in their servers' spools, then drop the journal's copy."""
        for trajectory in made:
            for server, part in self.client.split(trajectory).items():
                self.senders[server].started(part.task_tag)
                await self.senders[server].put(part, False)
        await asyncio.to_thread(self.journal.spooled, session)

    # ------------------------------------------------------------------ routes

    async def _forward(self, request: Request) -> Response:
        agent = request.path_params.get("agent") or request.headers.get(AGENT_HEADER) or "default"
        try:
            check_agent_name(agent)
        except ValueError as exc:
            return error(400, str(exc))
        return await self.forwarder.forward(request, agent, request.path_params["path"])

    async def _healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "gateway_id": self.book.gateway_id})

    async def _feedback(self, request: Request) -> Response:
        try:
            feedback = Feedback.model_validate_json(await request.body())
        except ValidationError as exc:
            return error(400, describe(exc), "invalid_request_error")
        try:
            result, made = await asyncio.to_thread(self.book.finish, feedback)
        except FeedbackError as exc:
            return error(exc.status, str(exc), "invalid_request_error")
        if made:
            await self._spool(result.session, made)
        return JSONResponse(result.model_dump(mode="json"))

    async def _close(self, request: Request) -> Response:
        session = self.book.find(request.path_params["session"])
        if session is None:
            return error(404, f"no open session '{request.path_params['session']}' on this gateway")
        await asyncio.to_thread(self.book.end, session)
        return JSONResponse({"session": session.row.id, "ended": session.row.ended})

    async def _session(self, request: Request) -> Response:
        session = self.book.find(request.path_params["session"])
        if session is None:
            done = self.journal.finished(request.path_params["session"])
            if done is None:
                return error(404, f"no session '{request.path_params['session']}' on this gateway")
            return JSONResponse(
                {
                    "session": done.session,
                    "key": done.key,
                    "outcome": done.outcome,
                    "reward": done.reward,
                    "trajectories": done.trajectories,
                }
            )
        answers = session.recorder.answers()
        n = session.row.fanout
        return JSONResponse(
            {
                "session": session.row.id,
                "key": session.row.key,
                "open": session.open,
                "calls": len(answers) - max(0, n - 1),
                "candidates": [a[0] if a else None for a in answers[:n]] if n else [],
                "trainable": session.row.tainted is None,
            }
        )

    async def _status(self, request: Request) -> Response:
        counts = await asyncio.to_thread(self.journal.counts)
        spooled = await asyncio.to_thread(lambda: sum(sender.spool.depth for sender in self.senders.values()))
        status = GatewayStatus(
            gateway_id=self.book.gateway_id,
            servers={"default": self.client.server_url, **self.client.agent_servers},
            counts=GatewayCounts(**counts),
            spooled=spooled,
            answers={
                "accepted": self.answers.accepted,
                "duplicate": self.answers.duplicate,
                "rejected": self.answers.rejected,
            },
            fan_out=self.config.fan_out,
            group_size=self.group_size,
            server_reachable=self.forwarder.reachable,
        )
        return JSONResponse(status.model_dump(mode="json"))
