"""AgentJet's aiohttp transport under httpx2 and the OpenAI SDK, against a real HTTP server on 127.0.0.1: what
the SDK sends arrives as sent, answers whole, streamed and gzip-encoded come back as the stock transport gives
them, and aiohttp's errors arrive as the httpx2 errors the SDK retries (a refused connection, a read timeout)."""

from __future__ import annotations

import asyncio
import gzip
import json
import threading
import time

import httpx2
import openai
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from agentjet_client.capture.aio import AiohttpTransport
from tests.conftest import free_port

ANSWER = {
    "id": "c1",
    "object": "chat.completion",
    "created": 1,
    "model": "m",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "seven"}, "finish_reason": "stop"}],
}
seen: list[dict] = []  # type: ignore[type-arg]


async def chat(request: Request) -> Response:
    body = json.loads(await request.body())
    seen.append({"body": body, "headers": dict(request.headers)})
    if body.get("slow"):
        await asyncio.sleep(2.0)
    if body.get("stream"):

        async def events():  # type: ignore[no-untyped-def]
            for word in ("se", "ven"):
                chunk = {
                    **ANSWER,
                    "object": "chat.completion.chunk",
                    "choices": [{"index": 0, "delta": {"content": word}}],
                }
                yield f"data: {json.dumps(chunk)}\n\n".encode()
                await asyncio.sleep(0.01)
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")
    if body.get("gzip"):
        return Response(
            gzip.compress(json.dumps(ANSWER).encode()),
            headers={"content-encoding": "gzip"},
            media_type="application/json",
        )
    return Response(json.dumps(ANSWER), media_type="application/json", headers={"x-answer": "yes"})


@pytest.fixture(scope="module")
def url():  # type: ignore[no-untyped-def]
    port = free_port()
    app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def sdk(base: str, **kwargs: object) -> openai.AsyncOpenAI:
    http = httpx2.AsyncClient(transport=AiohttpTransport(), timeout=kwargs.pop("timeout", 30.0))  # type: ignore[arg-type]
    return openai.AsyncOpenAI(base_url=base + "/v1", api_key="key-1", http_client=http, **kwargs)  # type: ignore[arg-type]


def test_the_sdk_over_aiohttp_sends_and_receives_as_on_its_own_transport(url):  # type: ignore[no-untyped-def]
    async def run() -> None:
        client = sdk(url)
        raw = await client.chat.completions.with_raw_response.create(
            model="m", messages=[{"role": "user", "content": "hi"}], extra_headers={"x-mine": "1"}
        )
        answer = raw.parse()
        assert answer.choices[0].message.content == "seven"
        assert raw.headers["x-answer"] == "yes" and raw.elapsed.total_seconds() > 0
        sent = seen[-1]
        assert sent["body"]["messages"] == [{"role": "user", "content": "hi"}]
        assert sent["headers"]["authorization"] == "Bearer key-1" and sent["headers"]["x-mine"] == "1"
        assert "aiohttp" not in sent["headers"].get("user-agent", "").lower()  # the SDK's own headers, not aiohttp's

        stream = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        words = [chunk.choices[0].delta.content async for chunk in stream]
        assert words == ["se", "ven"]

        zipped = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], extra_body={"gzip": True}
        )
        assert zipped.choices[0].message.content == "seven"  # httpx2 decoded it, once
        await client.close()

    asyncio.run(run())


def test_aiohttps_errors_arrive_as_the_ones_the_sdk_retries(url):  # type: ignore[no-untyped-def]
    async def run() -> None:
        refused = sdk(f"http://127.0.0.1:{free_port()}", max_retries=0)
        with pytest.raises(openai.APIConnectionError):
            await refused.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        slow = sdk(url, max_retries=0, timeout=httpx2.Timeout(0.3, connect=5.0))
        started = time.monotonic()
        with pytest.raises(openai.APITimeoutError):
            await slow.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], extra_body={"slow": True}
            )
        assert time.monotonic() - started < 1.5  # the read timeout applied, not the server's 2 s
        retried = sdk(url, max_retries=1, timeout=httpx2.Timeout(0.3, connect=5.0))
        before = len(seen)
        with pytest.raises(openai.APITimeoutError):
            await retried.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], extra_body={"slow": True}
            )
        assert len(seen) - before == 2  # a timeout is retried as on the stock transport
        for client in (refused, slow, retried):
            await client.close()

    asyncio.run(run())


def test_a_session_left_open_is_closed_when_its_loop_ends(url):  # type: ignore[no-untyped-def]
    import gc
    import warnings

    reported: list[str] = []
    transport = AiohttpTransport()

    async def run() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: reported.append(context["message"]))
        client = openai.AsyncOpenAI(
            base_url=url + "/v1", api_key="k", http_client=httpx2.AsyncClient(transport=transport)
        )
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        # no aclose: the loop's end closes the session

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        asyncio.run(run())
        gc.collect()
    assert transport._session is None  # closed inside the loop, before it ended
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)] and not reported
