"""CPU per LLM call, side by side in one run: what a captured call costs the client's process and what a chat
request costs the server's event-loop thread, each against its floor.

Client: one event loop making sequential calls to a stub server in a process of its own, which answers every
POST with the same body (a real answer of agentjet-server to the same request, captured at the start), so
only the client's own CPU is counted (``time.process_time`` over the calls):

    (a)  a bare aiohttp POST of the request body (the floor)
    (a') a bare httpx2 POST of it
    (b)  the OpenAI SDK's ``chat.completions.create`` on its stock transport
    (b') the same call on AgentJet's transport (``agentjet_client.capture.aio``)
    (c)  the same call through ``episode.async_openai()`` (capture), episodes of 4 calls, each episode's
         client as the agent gets it
    (d)  LangChain's ``ChatOpenAI.ainvoke`` and the Agents SDK's ``Runner.run``: stock, and through capture

Server: the CPU of the event-loop thread (the main thread: the engine's forward runs on a thread of its own
and is not counted) per chat request, 8 requests in flight, sent as a GRPO run sends them (each task's prompt
8 times in a row, every task's its own):

    (e)  a bare Starlette route under uvicorn that parses the same JSON and answers the captured body (the floor)
    (f)  agentjet-server's ``/v1/chat/completions`` with the embedded model
    (f') the same with no prompt ever sent twice (nothing the server kept of a prompt is of use)

Arms run in rounds, interleaved, and each figure is the median over rounds. Run:

    .venv/bin/python bench/overhead.py [--calls 200] [--rounds 5] [--profile ARM] [--client-only | --server-only]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import httpx2

from _server import served
from agentjet_client import SwarmClient
from agentjet_client.capture.aio import AiohttpTransport

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = ROOT / "packages" / "agentjet-server" / "src" / "agentjet_server" / "embedded" / "models" / "agentjet-tiny"
MESSAGES = [{"role": "user", "content": "Write seven as a digit."}]
REQUEST = {"model": "agentjet-tiny", "messages": MESSAGES, "max_tokens": 4, "temperature": 1.0}
IN_FLIGHT = 8
CLOCK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ----------------------------------------------------------------------------- the stub servers


def stub_aiohttp(port: int, body_file: str) -> None:
    """(its own process) Every POST answered with the captured body: the client side's counterpart."""
    from aiohttp import web

    body = Path(body_file).read_bytes()

    async def answer(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=body, content_type="application/json")

    app = web.Application()
    app.router.add_route("POST", "/{tail:.*}", answer)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def stub_starlette(port: int, body_file: str) -> None:
    """(its own process) (e): a bare Starlette route that parses the request's JSON and answers the body."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    body = Path(body_file).read_bytes()

    async def chat(request: Request) -> Response:
        json.loads(await request.body())
        return Response(body, media_type="application/json")

    app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", http="httptools")  # as our server


@contextlib.contextmanager
def stub(kind: str, body: bytes) -> Iterator[tuple[str, int]]:
    port = free_port()
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        f.write(body)
    command = [sys.executable, __file__, f"--{kind}", str(port), f.name]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            with contextlib.suppress(httpx2.HTTPError):
                httpx2.post(url + "/v1/chat/completions", json=REQUEST)
                break
            time.sleep(0.1)
        yield url, process.pid
    finally:
        process.terminate()
        process.wait(timeout=30)
        os.unlink(f.name)


# ----------------------------------------------------------------------------- the client's arms

Call = Callable[[], Awaitable[object]]


async def client_arms(url: str, client: SwarmClient) -> dict[str, tuple[Call, Callable[[], Awaitable[None]]]]:
    """Each arm: one call, and how to close what it holds."""
    import aiohttp
    import openai

    body = json.dumps({**REQUEST, "agentjet": {"agent": "default"}}).encode()
    session = aiohttp.ClientSession()
    plain = httpx2.AsyncClient()
    stock = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x")
    ours_http = httpx2.AsyncClient(transport=AiohttpTransport())
    ours = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", http_client=ours_http)
    headers = {"content-type": "application/json"}

    async def aiohttp_post() -> object:
        async with session.post(url + "/v1/chat/completions", data=body, headers=headers) as r:
            return await r.read()

    async def httpx2_post() -> object:
        return (await plain.post(url + "/v1/chat/completions", content=body, headers=headers)).content

    async def sdk(sdk_client: openai.AsyncOpenAI) -> object:
        return await sdk_client.chat.completions.create(**REQUEST)  # type: ignore[call-overload]

    state: dict[str, object] = {"calls": 0}

    async def captured() -> object:
        if state["calls"] % 4 == 0:  # type: ignore[operator]
            if "episode" in state:
                await state["episode"].aclose()  # type: ignore[attr-defined]
            state["episode"] = client.episode("task")
            state["sdk"] = state["episode"].async_openai()  # type: ignore[attr-defined]
        state["calls"] = state["calls"] + 1  # type: ignore[operator]
        return await sdk(state["sdk"])  # type: ignore[arg-type]

    async def close() -> None:
        await session.close()
        await plain.aclose()
        await stock.close()
        await ours.close()

    async def nothing() -> None:
        return None

    arms: dict[str, tuple[Call, Callable[[], Awaitable[None]]]] = {
        "(a) aiohttp POST": (aiohttp_post, close),
        "(a') httpx2 POST": (httpx2_post, nothing),
        "(b) OpenAI SDK, stock transport": (lambda: sdk(stock), nothing),
        "(b') OpenAI SDK, AgentJet's transport": (lambda: sdk(ours), nothing),
        "(c) OpenAI SDK through capture": (captured, nothing),
    }
    arms.update(framework_arms(url, client))
    return arms


def framework_arms(url: str, client: SwarmClient) -> dict[str, tuple[Call, Callable[[], Awaitable[None]]]]:
    """(d): LangChain and the Agents SDK, stock and through capture (a new episode every 4 calls)."""
    from agents import Agent, OpenAIChatCompletionsModel, Runner, set_tracing_disabled
    from langchain_openai import ChatOpenAI
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    stock_chain = ChatOpenAI(base_url=url + "/v1", api_key="x", model="agentjet-tiny", max_tokens=4)  # type: ignore[call-arg]
    stock_agent = Agent(
        name="a", model=OpenAIChatCompletionsModel("agentjet-tiny", AsyncOpenAI(base_url=url + "/v1", api_key="x"))
    )
    held: dict[str, object] = {"calls": 0}

    def episode_every_4() -> object:
        if held["calls"] % 4 == 0:  # type: ignore[operator]
            held["episode"] = client.episode("task")
        held["calls"] = held["calls"] + 1  # type: ignore[operator]
        return held["episode"]

    async def chain_captured() -> object:
        episode = episode_every_4()
        model = episode.langchain(model="agentjet-tiny", max_tokens=4)  # type: ignore[attr-defined]
        return await model.ainvoke(MESSAGES[0]["content"])

    async def agent_captured() -> object:
        episode = episode_every_4()
        model = OpenAIChatCompletionsModel("agentjet-tiny", episode.async_openai())  # type: ignore[attr-defined]
        return await Runner.run(Agent(name="a", model=model), MESSAGES[0]["content"])

    async def nothing() -> None:
        return None

    return {
        "(d) LangChain ainvoke, stock": (lambda: stock_chain.ainvoke(MESSAGES[0]["content"]), nothing),
        "(d) LangChain ainvoke through capture": (chain_captured, nothing),
        "(d) Agents SDK Runner.run, stock": (lambda: Runner.run(stock_agent, MESSAGES[0]["content"]), nothing),
        "(d) Agents SDK Runner.run through capture": (agent_captured, nothing),
    }


async def measure_client(url: str, calls: int, rounds: int, profile: str | None) -> dict[str, list[float]]:
    client = SwarmClient(url, async_transport_factory=AiohttpTransport if os.environ.get("AJ_AIO") else None)
    arms = await client_arms(url, client)
    figures: dict[str, list[float]] = {name: [] for name in arms}
    for call, _ in arms.values():  # warm: imports, connections, caches
        for _ in range(20):
            await call()
    for round_ in range(rounds):
        for name, (call, _) in arms.items():
            profiler = _profiler(profile, name)
            started = time.process_time()
            for _ in range(calls):
                await call()
            figures[name].append((time.process_time() - started) * 1000 / calls)
            if profiler is not None:
                profiler.disable()
                _dump(profiler, name)
        print(f"  client round {round_ + 1}/{rounds} done", file=sys.stderr, flush=True)
    for _, close in arms.values():
        await close()
    await client.aclose_pool()
    client.close()
    return figures


def _profiler(profile: str | None, name: str):  # type: ignore[no-untyped-def]
    if profile is None or not name.startswith(profile):
        return None
    import cProfile

    profiler = cProfile.Profile()
    profiler.enable()
    return profiler


def _dump(profiler, name: str) -> None:  # type: ignore[no-untyped-def]
    import pstats

    print(f"\n--- profile of {name} (cumulative, top 40; AgentJet's own and construction) ---")
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(os.environ.get("PROFILE_FILTER", ""), 40)


# ----------------------------------------------------------------------------- the server's arms


def thread_cpu(pid: int, tid: int) -> float:
    """Seconds of CPU thread ``tid`` of process ``pid`` has used (user + system)."""
    fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK


def request_bodies(requests: int, group: int, first_task: int) -> list[bytes]:
    """Chat requests as a GRPO run sends them: each task's prompt ``group`` times in a row, every task's
    prompt its own, tasks numbered from ``first_task`` (``group`` 1: no prompt is sent twice)."""
    bodies = []
    for i in range(requests):
        task = first_task + i // group
        messages = [{"role": "user", "content": f"Task {task}: write {task % 10} as a digit."}]
        bodies.append(json.dumps({**REQUEST, "messages": messages, "agentjet": {"agent": "default"}}).encode())
    return bodies


async def load(url: str, bodies: list[bytes]) -> None:
    import aiohttp

    headers = {"content-type": "application/json"}
    async with aiohttp.ClientSession() as session:
        queue = iter(bodies)

        async def worker() -> None:
            for body in queue:
                async with session.post(url + "/v1/chat/completions", data=body, headers=headers) as r:
                    assert r.status == 200, await r.text()
                    await r.read()

        await asyncio.gather(*(worker() for _ in range(IN_FLIGHT)))


def measure_server(url: str, pid: int, bodies: list[bytes]) -> float:
    """ms of the main thread's CPU per request, over ``bodies`` after the first 50 (a warm-up)."""
    asyncio.run(load(url, bodies[:50]))
    before = thread_cpu(pid, pid)
    asyncio.run(load(url, bodies[50:]))
    return (thread_cpu(pid, pid) - before) * 1000 / (len(bodies) - 50)


# ----------------------------------------------------------------------------- the run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=200, help="calls per arm per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--server-requests", type=int, default=1000, help="requests per server arm per round")
    parser.add_argument("--profile", help="profile the client arm whose name starts with this, e.g. '(c)'")
    parser.add_argument("--client-only", action="store_true", help="the client's arms alone")
    parser.add_argument("--server-only", action="store_true", help="the server's arms alone")
    parser.add_argument("--aiohttp-stub", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--starlette-stub", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.aiohttp_stub:
        return stub_aiohttp(int(args.aiohttp_stub[0]), args.aiohttp_stub[1])
    if args.starlette_stub:
        return stub_starlette(int(args.starlette_stub[0]), args.starlette_stub[1])

    pids: list[int] = []
    print("starting agentjet-server with the embedded model ...", file=sys.stderr, flush=True)
    with served(MODEL_DIR, "--serve-only", pids=pids) as url:
        body = json.dumps({**REQUEST, "agentjet": {"agent": "default"}}).encode()
        answer = httpx2.post(url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        assert answer.status_code == 200, answer.text
        canned = answer.content
        bare, grouped, fresh = "(e) bare Starlette route", "(f) agentjet-server chat", "(f') every prompt new"
        server_figures: dict[str, list[float]] = {bare: [], grouped: [], fresh: []}
        requests = args.server_requests + 50
        with stub("starlette-stub", canned) as (bare_url, bare_pid):
            for round_ in range(0 if args.client_only else args.rounds):
                first = 10**6 * (round_ + 1)  # prompts no earlier round sent
                server_figures[bare].append(measure_server(bare_url, bare_pid, request_bodies(requests, 8, first)))
                server_figures[grouped].append(measure_server(url, pids[0], request_bodies(requests, 8, first)))
                server_figures[fresh].append(measure_server(url, pids[0], request_bodies(requests, 1, first * 7)))
                print(f"  server round {round_ + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    if args.server_only:
        return report_lines("server: CPU of the event-loop thread per request (ms)", server_figures)
    with stub("aiohttp-stub", canned) as (stub_url, _):
        client_figures = asyncio.run(measure_client(stub_url, args.calls, args.rounds, args.profile))
    if args.client_only:
        return report_lines("client: CPU per call (ms, median of rounds)", client_figures)
    report(client_figures, server_figures)


def report_lines(title: str, figures: dict[str, list[float]]) -> None:
    print(title)
    for name, values in figures.items():
        print(f"  {name:44s} {statistics.median(values):6.3f}   rounds {' '.join(f'{v:.3f}' for v in values)}")


def report(client: dict[str, list[float]], server: dict[str, list[float]]) -> None:
    med = {name: statistics.median(values) for name, values in {**client, **server}.items()}
    print("\nclient: CPU per call (ms, median of rounds)")
    for name, values in client.items():
        print(f"  {name:44s} {med[name]:6.3f}   rounds {' '.join(f'{v:.3f}' for v in values)}")
    print("server: CPU of the event-loop thread per request (ms)")
    for name, values in server.items():
        print(f"  {name:44s} {med[name]:6.3f}   rounds {' '.join(f'{v:.3f}' for v in values)}")
    b, b2, c = (
        med["(b) OpenAI SDK, stock transport"],
        med["(b') OpenAI SDK, AgentJet's transport"],
        med["(c) OpenAI SDK through capture"],
    )
    e, f, f2 = med["(e) bare Starlette route"], med["(f) agentjet-server chat"], med["(f') every prompt new"]
    print("\nratios")
    print(f"  (c) / (b)   capture over the stock SDK call      {c / b:.2f}x   (target <= 1.25)")
    print(f"  (b') / (b)  our transport under the SDK          {b2 / b:.2f}x   (target <= 0.75)")
    print(f"  (f) / (e)   our chat route over a bare route     {f / e:.2f}x   (target <= 2)")
    print(f"  (f') / (e)  the same, no prompt sent twice       {f2 / e:.2f}x")
    print(f"  (b) / (a)   the stock SDK call over an aiohttp POST {b / med['(a) aiohttp POST']:.2f}x")
    for framework in ("LangChain ainvoke", "Agents SDK Runner.run"):
        stock = med[f"(d) {framework}, stock"]
        print(f"  (d) {framework}: capture / stock {med[f'(d) {framework} through capture'] / stock:.2f}x")


if __name__ == "__main__":
    main()
