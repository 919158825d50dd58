"""The gateway's front door: a deployed agent's API call, forwarded to its swarm server and captured.

Every API the server speaks goes through (chat completions, Responses, Messages, text completions,
streamed or not; anything else, say ``GET /v1/models``, is passed on as it is). A sampling call is recorded
into its session (``sessions``) and journaled before the last byte of its answer is released, so an
answered call is never lost. With ``fan_out`` the first call of a session (chat or text completions,
``n`` unset) is sent with ``n = fan_out``: the caller gets the first candidate only, the others wait in
the session for their rewards.

Opted-out calls (``X-AgentJet-Train: no``, or every call without ``X-AgentJet-Train: yes`` when training
is opt-in) are forwarded and recorded nowhere. The redaction hook rewrites every text of a request
before it leaves the gateway: the model, the journal, the spool and the server all see its output only.

When the training server cannot be reached (or answers 503), a call goes to the ``fallback`` endpoint if
there is one (the session can no longer be trained token-exact: it is dropped at its feedback, counted as
``fallback``), else it gets a 503 saying so.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, NamedTuple

import httpx2
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from agentjet_client.capture.aio import AiohttpTransport
from agentjet_client.capture.proxy import HOP_HEADERS
from agentjet_client.capture.recorder import SSECollector, api_of, chat_form, parse_request_body, with_claim
from agentjet_client.gateway.sessions import LiveSession, SessionBook, prompt_key

logger = logging.getLogger(__name__)

SESSION_HEADER = "x-agentjet-session"
SESSION_ID_HEADER = "x-agentjet-session-id"
GROUP_HEADER = "x-agentjet-group"
TRAIN_HEADER = "x-agentjet-train"
AGENT_HEADER = "x-agentjet-agent"
_HOP = HOP_HEADERS | {"date", "server"}  # and the upstream server's own response headers
_YES, _NO = {"1", "yes", "true", "on"}, {"0", "no", "false", "off"}
TEXT_FIELDS = ("messages", "input", "prompt", "system", "instructions")


def error(
    status: int, message: str, kind: str = "gateway_error", headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": None, "code": None}}, status_code=status, headers=headers
    )


def redact_body(data: dict[str, Any], redact: Callable[[str], str]) -> tuple[dict[str, Any], bool]:
    """``data`` with ``redact`` applied to every string under its text fields (message contents, Responses
    input, a completion prompt, system prompts); and whether anything changed."""
    changed = False

    def walk(value: Any) -> Any:
        nonlocal changed
        if isinstance(value, str):
            out = redact(value)
            if not isinstance(out, str):
                raise TypeError(f"the redaction hook returned {type(out).__name__}, not str")
            changed = changed or out != value
            return out
        if isinstance(value, list):
            return [walk(v) for v in value]
        if isinstance(value, dict):
            return {
                k: (v if k in ("role", "type", "id", "call_id", "name", "tool_call_id") else walk(v))
                for k, v in value.items()
            }
        return value

    return {k: walk(v) if k in TEXT_FIELDS else v for k, v in data.items()}, changed


def session_key(request: Request, data: dict[str, Any]) -> str | None:
    """What names a call's session: the header, else the ``user`` the request names."""
    header = request.headers.get(SESSION_HEADER)
    if header:
        return header[:256]
    user = data.get("user")
    metadata = data.get("metadata")
    if not user and isinstance(metadata, dict):
        user = metadata.get("user_id")  # the Messages API's
    return f"user:{str(user)[:250]}" if user else None


def first_choice_only(event: bytes) -> bytes | None:
    """A streamed chat event with the choices of index 0 only (None when it carried only others)."""
    text = event.strip()
    if not text.startswith(b"data:") or text[5:].strip() == b"[DONE]":
        return event
    try:
        data = json.loads(text[5:])
    except ValueError:
        return event
    if not isinstance(data, dict) or not data.get("choices"):
        return event
    kept = [c for c in data["choices"] if int(c.get("index") or 0) == 0]
    if not kept:
        return None
    return b"data: " + json.dumps({**data, "choices": kept}).encode() + b"\n\n"


async def captured_stream(
    book: SessionBook,
    upstream: httpx2.Response,
    session: LiveSession,
    agent: str,
    chat: dict[str, Any],
    api: str,
    started: float,
    fan: int,
    note: dict[str, Any],
) -> AsyncIterator[bytes]:
    """Relay the stream; its last bytes go out only once the call is in the journal."""
    collector = SSECollector()
    buffer, held = b"", b""  # a partial event; the newest whole one (released once journaled)
    finished = False
    try:
        async for chunk in upstream.aiter_bytes():
            collector.feed(chunk)
            *whole, buffer = (buffer + chunk).split(b"\n\n")
            events = [event + b"\n\n" for event in whole]
            if fan:
                events = [kept for kept in map(first_choice_only, events) if kept is not None]
            if events:
                out, held = held + b"".join(events[:-1]), events[-1]
                if out:
                    yield out
        finished = True
    finally:
        await upstream.aclose()
        if not finished:  # the server's stream broke off, or the caller left: nothing was answered
            book.release(session)
    session.recorder.record_chunks(agent, chat, collector.chunks, started, api)
    final = [
        c["response"]
        for c in collector.chunks
        if c.get("type") == "response.completed" and isinstance(c.get("response"), dict)
    ]
    if api == "responses" and final:
        history = [*note.pop("response_items"), *(final[-1].get("output") or [])]
        note.update(response_id=final[-1].get("id"), response_items=history)
    else:
        note.pop("response_items", None)
    await book.note_call(session, **note)
    if fan and buffer.strip():
        buffer = first_choice_only(buffer) or b""
    if held + buffer:
        yield held + buffer


async def prepare(
    api: str | None, data: dict[str, Any], body: bytes, redact: Callable[[str], str] | None, book: SessionBook
) -> Response | tuple[dict[str, Any], bytes, str | None]:
    """The request as it goes on: redacted (``--redact``), and a Responses call that names its previous
    response given the whole conversation (the server keeps no responses); or the error to answer."""
    if api is not None and redact is not None and data:
        try:
            data, changed = redact_body(data, redact)
        except Exception as exc:  # the user's hook: refuse rather than forward unredacted text
            logger.exception("the redaction hook failed")
            return error(500, f"the gateway's redaction hook failed ({type(exc).__name__}: {exc}); fix the hook")
        if changed:
            body = json.dumps(data).encode()
    previous = data.get("previous_response_id") if api == "responses" else None
    if not isinstance(previous, str):
        return data, body, None
    prior = await asyncio.to_thread(book.journal.response_items, previous)
    if prior is None:
        return error(
            400,
            f"previous_response_id '{previous}' is no response of an unfinished session of this gateway; send "
            "the whole conversation in 'input' instead",
            "invalid_request_error",
        )
    given = data.get("input")
    items = [{"role": "user", "content": given}] if isinstance(given, str) else list(given or [])
    data = {**{k: v for k, v in data.items() if k != "previous_response_id"}, "input": [*prior, *items]}
    return data, json.dumps(data).encode(), previous


class _Call(NamedTuple):
    """A captured call on its way: its session, agent, chat form, API, start time and fan-out."""

    session: LiveSession
    agent: str
    chat: dict[str, Any]
    api: str
    started: float
    fan: int


class Forwarder:
    """Forwards and captures the calls of deployed agents (see the module docstring)."""

    def __init__(
        self,
        book: SessionBook,
        server_for: Callable[[str], str],
        *,
        api_key: str | None = None,
        fan_out: int = 0,
        opt_in: bool = False,
        redact: Callable[[str], str] | None = None,
        fallback: str | None = None,
        transport: httpx2.AsyncBaseTransport | None = None,
    ) -> None:
        self.book, self.server_for, self.api_key = book, server_for, api_key
        self.fan_out, self.opt_in, self.redact = fan_out, opt_in, redact
        self.fallback = fallback.rstrip("/") if fallback else None
        self.reachable = True
        # upstream calls go out on aiohttp (C parsing, C connection pool) under httpx2's interface: httpx2's own
        # pure-Python HTTP stack was about half of the gateway's CPU a call (``bench/gateway.py``)
        self.http = httpx2.AsyncClient(
            transport=transport or AiohttpTransport(max_connections=1024), timeout=httpx2.Timeout(600.0, connect=10.0)
        )

    async def aclose(self) -> None:
        await self.http.aclose()

    def trains(self, request: Request) -> bool:
        said = (request.headers.get(TRAIN_HEADER) or "").strip().lower()
        if said in _NO:
            return False
        return said in _YES or not self.opt_in

    def _headers(self, request: Request) -> dict[str, str]:
        headers = {
            k: v
            for k, v in request.headers.items()
            if k.lower() not in _HOP and not k.lower().startswith("x-agentjet-")
        }
        if self.api_key:
            headers["authorization"] = f"Bearer {self.api_key}"
        elif "authorization" in request.headers:
            headers["authorization"] = request.headers["authorization"]
        return headers

    async def forward(self, request: Request, agent: str, path: str) -> Response:
        body = await request.body()
        api = api_of(request.method, "/" + path)
        data = parse_request_body(body) if api is not None else {}
        prepared = await prepare(api, data, body, self.redact, self.book)
        if isinstance(prepared, Response):
            return prepared
        data, body, previous = prepared
        chat = chat_form(api, data) if api is not None and data else None
        if api is None or chat is None:
            return await self._plain(request, agent, path, body)
        if not self.trains(request):
            return await self._untrained(request, agent, path, body, data)
        key = session_key(request, data)
        if previous is None:  # in memory only: no worker thread needed
            session, new = self.book.session_for(key, None)
        else:  # the previous response's session is looked up in the journal
            session, new = await asyncio.to_thread(self.book.session_for, key, previous)
        fan = 0
        if new and self.fan_out > 1 and api in ("chat", "completions") and data.get("n") in (None, 1):
            fan = self.fan_out
            data = {**data, "n": fan}
        group_key = None
        if new:
            group_key = request.headers.get(GROUP_HEADER) or (
                prompt_key(agent, chat) if self.book.group_by == "prompt" else None
            )
        sent = with_claim(json.dumps(data).encode() if fan else body, session.recorder.extension(agent, chat))
        headers = self._headers(request)
        url = f"{self.server_for(agent)}/v1/{path}"
        started = time.time()
        tagged = {SESSION_HEADER: session.row.key, SESSION_ID_HEADER: session.row.id}
        try:
            upstream = await self.http.send(
                self.http.build_request(
                    request.method, url, content=sent, headers=headers, params=request.query_params
                ),
                stream=True,
            )
        except httpx2.TransportError as exc:
            self.reachable = False
            return await self._unreachable(request, path, body, session, agent, str(exc), tagged)
        if upstream.status_code == 503:
            reason = (await upstream.aread()).decode(errors="replace")[:300]
            await upstream.aclose()
            return await self._unreachable(request, path, body, session, agent, reason, tagged)
        if upstream.status_code != 200:
            self.book.release(session)
        self.reachable = True
        out_headers = {
            **{k: v for k, v in upstream.headers.items() if k.lower() not in _HOP | {"content-encoding"}},
            **tagged,
        }
        note: dict[str, Any] = {"group_key": group_key, "fanout": fan or None}
        asked = data.get("input") if api == "responses" else None
        history = [{"role": "user", "content": asked}] if isinstance(asked, str) else list(asked or [])
        if "text/event-stream" in upstream.headers.get("content-type", "") and upstream.status_code == 200:
            relay = captured_stream(
                self.book, upstream, session, agent, chat, api, started, fan, {**note, "response_items": history}
            )
            return StreamingResponse(relay, status_code=200, headers=out_headers)
        call = _Call(session, agent, chat, api, started, fan)
        return await self._answer(upstream, call, note, history, out_headers)

    async def _answer(
        self,
        upstream: httpx2.Response,
        call: _Call,
        note: dict[str, Any],
        history: list[Any],
        out_headers: dict[str, str],
    ) -> Response:
        """A whole (not streamed) answer: recorded into its session and relayed (the first choice alone of
        a fanned-out call)."""
        session, agent, chat, api, started, fan = call
        try:
            raw = await upstream.aread()
        except httpx2.HTTPError as exc:
            await upstream.aclose()
            if upstream.status_code == 200:
                self.book.release(session)
            return error(502, f"the server's answer broke off: {exc}")
        await upstream.aclose()
        if upstream.status_code != 200:
            return Response(raw, status_code=upstream.status_code, headers=out_headers)
        try:
            parsed: Any = json.loads(raw)
        except ValueError:
            parsed = None
        session.recorder.record_response(agent, chat, parsed, started, api)
        if api == "responses" and isinstance(parsed, dict):
            note.update(response_id=parsed.get("id"), response_items=[*history, *(parsed.get("output") or [])])
        await self.book.note_call(session, **note)
        if fan and isinstance(parsed, dict) and parsed.get("choices"):
            parsed = {**parsed, "choices": [c for c in parsed["choices"] if int(c.get("index") or 0) == 0]}
            raw = json.dumps(parsed).encode()
        return Response(raw, status_code=200, headers=out_headers)

    async def _plain(self, request: Request, agent: str, path: str, body: bytes) -> Response:
        """Forward without capture (not a sampling call, or not one the server would take)."""
        try:
            upstream = await self.http.request(
                request.method,
                f"{self.server_for(agent)}/v1/{path}",
                content=body,
                headers=self._headers(request),
                params=request.query_params,
            )
        except httpx2.TransportError as exc:
            self.reachable = False
            return self._no_server(agent, str(exc))
        out = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP | {"content-encoding"}}
        return Response(upstream.content, status_code=upstream.status_code, headers=out)

    async def _untrained(self, request: Request, agent: str, path: str, body: bytes, data: dict[str, Any]) -> Response:
        """An opted-out call: forwarded, recorded nowhere; an open session of its key is dropped untrained."""
        key = session_key(request, data)
        found = self.book.find(key) if key is not None else None
        if found is not None:
            await asyncio.to_thread(self.book.drop, found, "opted_out")
        routed = with_claim(body, {"agent": agent})  # routed by a client: the agent's own model name is taken
        response = await self._stream_plain(request, f"{self.server_for(agent)}/v1/{path}", routed, agent, body)
        if response.status_code == 200:
            await asyncio.to_thread(self.book.journal.count, "untrained_calls")
        if key is not None:
            response.headers[SESSION_HEADER] = key
        return response

    async def _stream_plain(
        self, request: Request, url: str, body: bytes, agent: str, fallback_body: bytes | None = None
    ) -> Response:
        """Forward as it is, streamed through; while the server is down, to the fallback (``fallback_body``)."""
        try:
            upstream = await self.http.send(
                self.http.build_request(request.method, url, content=body, headers=self._headers(request)), stream=True
            )
        except httpx2.TransportError as exc:
            if self.fallback is not None and not url.startswith(self.fallback):
                return await self._stream_plain(request, self._fallback_url(url, agent), fallback_body or body, agent)
            return self._no_server(agent, str(exc))
        out = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP | {"content-encoding"}}

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_bytes():
                    yield chunk
            finally:
                await upstream.aclose()

        return StreamingResponse(relay(), status_code=upstream.status_code, headers=out)

    def _fallback_url(self, url: str, agent: str) -> str:
        assert self.fallback is not None
        return self.fallback + url[len(f"{self.server_for(agent)}/v1") :]

    async def _unreachable(
        self,
        request: Request,
        path: str,
        body: bytes,
        session: LiveSession,
        agent: str,
        reason: str,
        tagged: dict[str, str],
    ) -> Response:
        """The training server did not answer: the fallback endpoint answers (and the session is no longer
        trainable), or a 503 says so."""
        if self.fallback is None:
            self.book.release(session)
            return self._no_server(agent, reason, tagged)
        await self.book.note_call(session, tainted=f"answered by the fallback endpoint: {reason[:200]}")
        response = await self._stream_plain(request, f"{self.fallback}/{path}", body, agent)
        response.headers.update(tagged)
        return response

    def _no_server(self, agent: str, reason: str, tagged: dict[str, str] | None = None) -> JSONResponse:
        return error(
            503,
            f"the training server of agent '{agent}' ({self.server_for(agent)}) is not answering ({reason[:300]}); "
            "retry shortly (the gateway forwards again as soon as it is back), or start the gateway with "
            "--fallback URL to answer from another endpoint meanwhile",
            "server_unavailable",
            headers={"retry-after": "5", **(tagged or {})},
        )
