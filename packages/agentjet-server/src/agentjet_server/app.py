"""The ASGI app: the routes of ``api/`` over one ``SwarmRuntime``, OpenAI-shaped error handlers, and a
lifespan that gives the event loop its named worker threads and closes the runtime at the end."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.middleware import Middleware

from agentjet_server.api import HANDLERS, ROUTES, Api
from agentjet_server.engine.base import Engine
from agentjet_server.observe.tracing import TracingMiddleware
from agentjet_server.runtime import SwarmRuntime, create_runtime
from agentjet_server.settings import ServerSettings

WORKER_THREADS = "agentjet-server-worker"


def create_app(
    engine: Engine,
    settings: ServerSettings,
    runtime: SwarmRuntime | None = None,
    model_path: str | None = None,
    on_stop: Callable[[], None] | None = None,
) -> Starlette:
    """The ASGI app. ``runtime`` defaults to a new one over ``engine`` (its learner starts now).
    ``on_stop`` ends the process's HTTP server (``POST /v1/admin/stop``); without it, stop is refused."""
    rt = runtime or create_runtime(engine, settings, model_path or str(engine.model_path))
    api = Api(rt, settings, on_stop)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # CPU work (parsing, rendering, detokenising) and fsyncs run in worker threads that say
        # whose they are (``asyncio.to_thread`` uses the loop's default executor)
        workers = ThreadPoolExecutor(thread_name_prefix=WORKER_THREADS)
        asyncio.get_running_loop().set_default_executor(workers)
        yield
        api.gate.close()
        rt.close()

    # each API request a span under the trace its headers carry (when tracing is configured)
    middleware = [Middleware(TracingMiddleware)]
    app = Starlette(routes=ROUTES, exception_handlers=HANDLERS, lifespan=lifespan, middleware=middleware)
    app.state.runtime = rt
    app.state.api = api
    return app
