"""httpx2 transports that capture chat completions on their way through the OpenAI SDK.

The wrapped transport is usually the ``SwarmClient``'s shared connection pool, so episodes
cost no new connections; an episode closing its SDK client leaves that pool open.

openai-python runs on httpx2, so ``episode.openai()`` hands the SDK an ``httpx2.Client``
whose transport is a ``CaptureTransport``: every ``POST .../chat/completions`` is passed to the
real transport unchanged, and its response (whole or streamed) is recorded into the episode.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx2

from agentjet_client.capture import EpisodeRecorder, SSECollector, is_chat_request, parse_request_body


class _TeeStream(httpx2.SyncByteStream):
    def __init__(self, inner: httpx2.SyncByteStream, on_done: Any) -> None:
        self._inner = inner
        self._collector = SSECollector()
        self._on_done = on_done
        self._done = False

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self._inner:
            self._collector.feed(chunk)
            yield chunk
        self._finish()

    def _finish(self) -> None:
        if not self._done:
            self._done = True
            self._on_done(self._collector.chunks)

    def close(self) -> None:
        try:
            self._inner.close()
        finally:
            self._finish()


class _AsyncTeeStream(httpx2.AsyncByteStream):
    def __init__(self, inner: httpx2.AsyncByteStream, on_done: Any) -> None:
        self._inner = inner
        self._collector = SSECollector()
        self._on_done = on_done
        self._done = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._inner:
            self._collector.feed(chunk)
            yield chunk
        self._finish()

    def _finish(self) -> None:
        if not self._done:
            self._done = True
            self._on_done(self._collector.chunks)

    async def aclose(self) -> None:
        try:
            await self._inner.aclose()
        finally:
            self._finish()


def _is_sse(response: httpx2.Response) -> bool:
    return "text/event-stream" in response.headers.get("content-type", "")


class CaptureTransport(httpx2.BaseTransport):
    """Wraps a sync transport; records chat completions into ``recorder`` as ``agent``."""

    def __init__(
        self, recorder: EpisodeRecorder, agent: str, inner: httpx2.BaseTransport, *, owns_inner: bool = False
    ) -> None:
        self.recorder = recorder
        self.agent = agent
        self.inner = inner
        self.owns_inner = owns_inner

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        if not is_chat_request(request.method, request.url.path):
            return self.inner.handle_request(request)
        started = time.time()
        body = parse_request_body(request.read())
        response = self.inner.handle_request(request)
        if response.status_code != 200:
            return response
        if _is_sse(response):
            assert isinstance(response.stream, httpx2.SyncByteStream)
            tee = _TeeStream(
                response.stream, lambda chunks: self.recorder.record_chunks(self.agent, body, chunks, started)
            )
            return httpx2.Response(
                response.status_code,
                headers=response.headers,
                stream=tee,
                request=request,
                extensions=response.extensions,
            )
        assert isinstance(response.stream, httpx2.SyncByteStream)
        raw = b"".join(response.stream)
        response.close()
        out = httpx2.Response(
            response.status_code,
            headers=response.headers,
            stream=httpx2.ByteStream(raw),
            request=request,
            extensions=response.extensions,
        )
        out.read()
        try:
            parsed = out.json()
        except ValueError:
            parsed = None
        self.recorder.record_response(self.agent, body, parsed, started)
        return out

    def close(self) -> None:
        if self.owns_inner:  # a shared connection pool outlives the episode
            self.inner.close()


class AsyncCaptureTransport(httpx2.AsyncBaseTransport):
    """Async twin of ``CaptureTransport``."""

    def __init__(
        self, recorder: EpisodeRecorder, agent: str, inner: httpx2.AsyncBaseTransport, *, owns_inner: bool = False
    ) -> None:
        self.recorder = recorder
        self.agent = agent
        self.inner = inner
        self.owns_inner = owns_inner

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        if not is_chat_request(request.method, request.url.path):
            return await self.inner.handle_async_request(request)
        started = time.time()
        body = parse_request_body(await request.aread())
        response = await self.inner.handle_async_request(request)
        if response.status_code != 200:
            return response
        if _is_sse(response):
            assert isinstance(response.stream, httpx2.AsyncByteStream)
            tee = _AsyncTeeStream(
                response.stream, lambda chunks: self.recorder.record_chunks(self.agent, body, chunks, started)
            )
            return httpx2.Response(
                response.status_code,
                headers=response.headers,
                stream=tee,
                request=request,
                extensions=response.extensions,
            )
        raw = b"".join([chunk async for chunk in response.stream])  # type: ignore[union-attr]
        await response.aclose()
        out = httpx2.Response(
            response.status_code,
            headers=response.headers,
            stream=httpx2.ByteStream(raw),
            request=request,
            extensions=response.extensions,
        )
        await out.aread()
        try:
            parsed = out.json()
        except ValueError:
            parsed = None
        self.recorder.record_response(self.agent, body, parsed, started)
        return out

    async def aclose(self) -> None:
        if self.owns_inner:
            await self.inner.aclose()
