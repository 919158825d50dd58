"""An httpx2 transport over aiohttp's client: what the SDKs' async calls in an episode travel on.

openai-python (and Anthropic's, LangChain's and AgentScope's clients over it) build their requests with
httpx2 and hand them to a transport. httpx2's own (``AsyncHTTPTransport``, on httpcore and h11) parses HTTP
in pure Python, about half of the CPU a bare httpx2 POST costs on loopback; aiohttp's client parses with its
C extension (llhttp) and keeps its connections in a C-accelerated pool. The SDK's request building and
response models stay as they are; only the wire underneath changes (``bench/overhead.py`` measures it).

Everything httpx2 expects of a transport holds: the request's headers and body go out as they are (no
headers of aiohttp's own, no decompression: httpx2 decodes ``content-encoding`` itself), streamed answers
stream chunk by chunk, the request's timeouts apply, and aiohttp's errors arrive as httpx2's (``ConnectError``,
``ReadTimeout``, ``RemoteProtocolError``...), which the SDKs retry as they would their own.

An aiohttp session belongs to one event loop: the ``SwarmClient`` keeps one transport per running loop. A
session left open when its loop ends would be reported ("Unclosed client session") and its sockets leaked,
so each session is closed by the loop's own end as well: an async generator held open beside it, which
``asyncio.run`` (any runner that calls ``loop.shutdown_asyncgens()``) closes after the loop's tasks, closes it.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import aiohttp
import httpx2

# what aiohttp would add to a request on its own, and what it must compute itself from the body it sends
_SKIP_AUTO = ("User-Agent", "Accept-Encoding", "Accept", "Content-Type")
_OWN = {"content-length", "transfer-encoding", "connection", "host"}


class _Body(httpx2.AsyncByteStream):
    """An aiohttp response's body, chunk by chunk as it arrives; closing it returns the connection."""

    def __init__(self, response: aiohttp.ClientResponse, request: httpx2.Request) -> None:
        self._response, self._request = response, request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise _translate(exc, self._request) from exc

    async def aclose(self) -> None:
        self._response.release()


class AiohttpTransport(httpx2.AsyncBaseTransport):
    """``httpx2.AsyncBaseTransport`` over one ``aiohttp.ClientSession`` (made on first use, in the running
    event loop) with at most ``max_connections`` connections."""

    def __init__(self, max_connections: int = 256) -> None:
        self.max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self._guard: AsyncGenerator[None, None] | None = None

    async def _open(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self.max_connections, ttl_dns_cache=300)
            self._session = aiohttp.ClientSession(
                connector=connector,
                auto_decompress=False,  # httpx2 decodes content-encoding from the headers it is given
                skip_auto_headers=_SKIP_AUTO,
                timeout=aiohttp.ClientTimeout(total=None),
                cookie_jar=aiohttp.DummyCookieJar(),  # httpx2's client keeps the cookies, if any
            )
            self._guard = self._closed_with_the_loop()
            await self._guard.__anext__()
        return self._session

    async def _closed_with_the_loop(self) -> AsyncGenerator[None, None]:
        try:
            yield
        finally:
            session, self._session = self._session, None
            if session is not None and not session.closed:
                await session.close()

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        session = await self._open()
        body = await request.aread()
        headers = [(k, v) for k, v in request.headers.multi_items() if k.lower() not in _OWN]
        try:
            response = await session.request(
                request.method,
                str(request.url),
                headers=headers,
                data=body or None,
                allow_redirects=False,  # httpx2 follows redirects itself when asked
                timeout=_timeout(request),
                compress=None,
            )
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise _translate(exc, request) from exc
        return httpx2.Response(
            response.status,
            headers=[(k.decode("latin-1"), v.decode("latin-1")) for k, v in response.raw_headers],
            stream=_Body(response, request),
            request=request,
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": (response.reason or "").encode()},
        )

    async def aclose(self) -> None:
        guard, self._guard = self._guard, None
        if guard is not None:
            await guard.aclose()  # closes the session


def _timeout(request: httpx2.Request) -> aiohttp.ClientTimeout:
    """The request's httpx2 timeouts (connect, read, pool) as aiohttp's."""
    timeouts: dict[str, Any] = request.extensions.get("timeout") or {}
    return aiohttp.ClientTimeout(
        total=None,
        connect=timeouts.get("pool"),
        sock_connect=timeouts.get("connect"),
        sock_read=timeouts.get("read"),
    )


def _translate(exc: BaseException, request: httpx2.Request) -> httpx2.TransportError:
    """aiohttp's error as the httpx2 error an SDK retries the same way."""
    message = str(exc) or type(exc).__name__
    if isinstance(exc, aiohttp.ServerTimeoutError | TimeoutError):
        if isinstance(exc, aiohttp.ConnectionTimeoutError):
            return httpx2.ConnectTimeout(message, request=request)
        return httpx2.ReadTimeout(message, request=request)
    if isinstance(exc, aiohttp.ClientConnectorError):
        return httpx2.ConnectError(message, request=request)
    if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError):
        return httpx2.RemoteProtocolError(message, request=request)
    if isinstance(exc, aiohttp.ClientOSError):
        return httpx2.ReadError(message, request=request)
    return httpx2.TransportError(message, request=request)
