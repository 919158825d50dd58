"""httpx2 transports that capture sampling calls on their way through an SDK.

The wrapped transport is the ``SwarmClient``'s shared connection pool, so episodes cost no new
connections; an episode closing its SDK client leaves that pool open.

openai-python runs on httpx2, so ``episode.openai()`` hands the SDK an ``httpx2.Client``
whose transport is a ``CaptureTransport``: every ``POST`` to a sampling API (``.../chat/completions``,
``.../responses``, ``.../messages``, ``.../completions``) is passed to the real transport with the
episode's ``agentjet`` extension added, and its response (whole or streamed) is recorded into the episode.
"""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx2

from agentjet_client import tracing
from agentjet_client.capture.recorder import (
    EpisodeRecorder,
    SSECollector,
    api_of,
    chat_form,
    parse_request_body,
)


class _Tee:
    """Feeds every chunk that passes to an SSE collector; reports the chunks once, at the end."""

    def __init__(self, on_done: Any) -> None:
        self._collector = SSECollector()
        self._on_done = on_done
        self._done = False

    def _finish(self) -> None:
        if not self._done:
            self._done = True
            self._on_done(self._collector.chunks)


class _TeeStream(_Tee, httpx2.SyncByteStream):
    def __init__(self, inner: httpx2.SyncByteStream, on_done: Any) -> None:
        super().__init__(on_done)
        self._inner = inner

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self._inner:
            self._collector.feed(chunk)
            yield chunk
        self._finish()

    def close(self) -> None:
        try:
            self._inner.close()
        finally:
            self._finish()


class _AsyncTeeStream(_Tee, httpx2.AsyncByteStream):
    def __init__(self, inner: httpx2.AsyncByteStream, on_done: Any) -> None:
        super().__init__(on_done)
        self._inner = inner

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._inner:
            self._collector.feed(chunk)
            yield chunk
        self._finish()

    async def aclose(self) -> None:
        try:
            await self._inner.aclose()
        finally:
            self._finish()


def _is_sse(response: httpx2.Response) -> bool:
    return "text/event-stream" in response.headers.get("content-type", "")


def _with_stream(
    request: httpx2.Request, response: httpx2.Response, stream: httpx2.SyncByteStream | httpx2.AsyncByteStream
) -> httpx2.Response:
    return httpx2.Response(
        response.status_code,
        headers=response.headers,
        stream=stream,
        request=request,
        extensions=response.extensions,
    )


def _extended(request: httpx2.Request, data: dict[str, Any], extension: dict[str, Any]) -> httpx2.Request:
    """``request`` (whose parsed body is ``data``) carrying the ``agentjet`` extension: the agent, and the
    claim of which earlier call it continues (see ``EpisodeRecorder.claim``)."""
    if not data or "agentjet" in data:
        return request
    content = json.dumps({**data, "agentjet": extension}).encode()
    headers = [(k, v) for k, v in request.headers.multi_items() if k.lower() != "content-length"]
    return httpx2.Request(request.method, request.url, headers=headers, content=content, extensions=request.extensions)


def _json_or_none(content: bytes) -> Any:
    try:
        return json.loads(content)
    except ValueError:
        return None


class _Capture:
    """What both transports share: which requests to record and where to."""

    def __init__(self, recorder: EpisodeRecorder, agent: str) -> None:
        self.recorder = recorder
        self.agent = agent
        self.record = True  # False: pass every request on, recording nothing (``episode.openai(train=False)``)

    def _on_stream_end(self, body: dict[str, Any], started: float, api: str) -> Any:
        return lambda chunks: self.recorder.record_chunks(self.agent, body, chunks, started, api)

    def _attributes(self, api: str) -> dict[str, str]:
        return {"agentjet.agent": self.agent, "agentjet.api": api}

    def _call(self, request: httpx2.Request, raw: bytes) -> tuple[str, dict[str, Any], httpx2.Request] | None:
        """The API a request samples from, the chat request it means and the request to send in its place
        (with the ``agentjet`` extension); None for anything else."""
        if not self.record:
            return None
        api = api_of(request.method, request.url.path)
        if api is None:
            return None
        data = parse_request_body(raw)
        chat = chat_form(api, data)
        if chat is None:
            return None
        return api, chat, _extended(request, data, self.recorder.extension(self.agent, chat))

    def _traced(self, api: str) -> Any:
        return tracing.span("chat", parent=self.recorder.trace, kind="client", attributes=self._attributes(api))


class CaptureTransport(_Capture, httpx2.BaseTransport):
    """Wraps a sync transport; records chat completions into ``recorder`` as ``agent``.

    ``inner`` is shared between episodes and is not closed with this transport.
    """

    def __init__(self, recorder: EpisodeRecorder, agent: str, inner: httpx2.BaseTransport) -> None:
        super().__init__(recorder, agent)
        self.inner = inner

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        call = self._call(request, request.read()) if request.method.upper() == "POST" else None
        if call is None:
            return self.inner.handle_request(request)
        started = time.time()
        api, body, request = call
        with self._traced(api) as span:
            if span is not None:
                tracing.inject(request.headers)
            response = self.inner.handle_request(request)
        if response.status_code != 200:
            return response
        assert isinstance(response.stream, httpx2.SyncByteStream)
        if _is_sse(response):
            return _with_stream(request, response, _TeeStream(response.stream, self._on_stream_end(body, started, api)))
        content = response.read()  # read (and closed) here: the response's elapsed time is set to match
        response.elapsed = datetime.timedelta(seconds=time.time() - started)
        self.recorder.record_response(self.agent, body, _json_or_none(content), started, api)
        return response


class AsyncCaptureTransport(_Capture, httpx2.AsyncBaseTransport):
    """Async twin of ``CaptureTransport``."""

    def __init__(
        self,
        recorder: EpisodeRecorder,
        agent: str,
        inner: httpx2.AsyncBaseTransport | Callable[[], httpx2.AsyncBaseTransport],
    ) -> None:
        super().__init__(recorder, agent)
        # a callable is asked per request: the shared pool of whichever event loop is running then
        # (so a model built outside any loop works inside the one that later runs it)
        self._inner = inner

    @property
    def inner(self) -> httpx2.AsyncBaseTransport:
        return self._inner if isinstance(self._inner, httpx2.AsyncBaseTransport) else self._inner()

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        call = self._call(request, await request.aread()) if request.method.upper() == "POST" else None
        if call is None:
            return await self.inner.handle_async_request(request)
        started = time.time()
        api, body, request = call
        with self._traced(api) as span:
            if span is not None:
                tracing.inject(request.headers)
            response = await self.inner.handle_async_request(request)
        if response.status_code != 200:
            return response
        assert isinstance(response.stream, httpx2.AsyncByteStream)
        if _is_sse(response):
            stream = _AsyncTeeStream(response.stream, self._on_stream_end(body, started, api))
            return _with_stream(request, response, stream)
        content = await response.aread()  # read (and closed) here: the response's elapsed time is set to match
        response.elapsed = datetime.timedelta(seconds=time.time() - started)
        self.recorder.record_response(self.agent, body, _json_or_none(content), started, api)
        return response
