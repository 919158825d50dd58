"""The model endpoint inside a sandbox that has no network: bytes relayed between a TCP port on the sandbox's
own loopback and a Unix socket that the host serves.

A sandbox cannot reach the host's loopback (it has a network namespace of its own), so the host listens on a
Unix socket in a directory bind-mounted into the sandbox (``relay``: each connection to it is piped to the
episode's model endpoint, the capture proxy on the host's loopback), and inside the sandbox this file runs as a
script with the sandbox's ``python3`` (standard library only) beside the command: it listens on
``127.0.0.1:PORT`` and pipes each connection to the socket. HTTP goes through untouched, so a harness pointed at
``http://127.0.0.1:PORT/<the endpoint's path>`` talks to the capture proxy as if it were there.

    python3 forwarder.py PORT SOCKET READY_FILE     (inside; READY_FILE is made once it listens)
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable

Connect = Callable[[], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy ``reader`` to ``writer`` until its end, then end ``writer``'s side (half-close where it can)."""
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        try:
            if writer.can_write_eof():
                writer.write_eof()
            else:
                writer.close()
        except (ConnectionError, OSError, RuntimeError):
            pass


def relay(connect: Connect) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
    """A connection handler that opens ``connect()`` and pipes both ways until both ends are done."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            upstream_reader, upstream_writer = await connect()
        except OSError:
            writer.close()
            return
        try:
            await asyncio.gather(pipe(reader, upstream_writer), pipe(upstream_reader, writer))
        finally:
            for end in (writer, upstream_writer):
                end.close()

    return handle


async def _serve_inside(port: int, socket_path: str, ready: str) -> None:
    server = await asyncio.start_server(relay(lambda: asyncio.open_unix_connection(socket_path)), "127.0.0.1", port)
    with open(ready, "w"):
        pass
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(_serve_inside(int(sys.argv[1]), sys.argv[2], sys.argv[3]))
