"""A TCP proxy on 127.0.0.1 that injects network faults between a client and a server.

Modes, switched at any time from another thread with ``set_mode``:
- ``pass``: forward bytes both ways;
- ``drop``: close every open connection and refuse new ones (a connection reset);
- ``blackhole``: accept connections and swallow their bytes, answer nothing (a partition); when
  the mode changes, the swallowed connections are closed;
- ``delay``: forward, holding each chunk for ``delay_s`` first.
"""

from __future__ import annotations

import asyncio
import socket
import threading


class FaultProxy:
    def __init__(self, target_port: int, delay_s: float = 0.2) -> None:
        self.target_port = target_port
        self.delay_s = delay_s
        self.mode = "pass"
        self.counts = {"connections": 0, "dropped": 0, "blackholed": 0}  # blackholed: connections + chunks
        self._writers: set[asyncio.StreamWriter] = set()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._ready.wait(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def set_mode(self, mode: str) -> None:
        assert mode in ("pass", "drop", "blackhole", "delay")
        self._loop.call_soon_threadsafe(self._switch, mode)

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def _switch(self, mode: str) -> None:
        previous, self.mode = self.mode, mode
        if mode == "drop" or previous == "blackhole":
            for writer in list(self._writers):
                writer.transport.abort()
            self._writers.clear()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", self.port))
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            server.close()
            for writer in list(self._writers):
                writer.transport.abort()
            for task in asyncio.all_tasks(self._loop):
                task.cancel()
            self._loop.run_until_complete(asyncio.sleep(0))
            self._loop.run_until_complete(server.wait_closed())

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.counts["connections"] += 1
        if self.mode == "drop":
            self.counts["dropped"] += 1
            writer.transport.abort()
            return
        self._writers.add(writer)
        if self.mode == "blackhole":
            self.counts["blackholed"] += 1
            while await reader.read(65536):
                pass
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self._writers.add(up_writer)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while chunk := await src.read(65536):
                    if self.mode == "delay":
                        await asyncio.sleep(self.delay_s)
                    if self.mode == "drop":
                        break
                    if self.mode == "blackhole":  # swallowed; the connection is cut when the partition heals
                        self.counts["blackholed"] += 1
                        continue
                    dst.write(chunk)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.transport.abort()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self._writers.discard(writer)
        self._writers.discard(up_writer)
