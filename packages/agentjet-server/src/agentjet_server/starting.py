"""The port while the server starts: bound at once, answering what the server is doing.

Building an embedded model whose spec changed, loading a large model into vLLM or restoring a
checkpoint can take minutes. Until the app serves, ``StartingPort`` holds the listening socket and
answers every request ``503`` in OpenAI's error shape, with a ``Retry-After`` and the phase the
start is in ("building the embedded model agentjet-tools: warm-up step 120/400, for 2m05s"), so a
client says that instead of "cannot reach the server". ``hand_over`` stops answering and gives the
same socket to uvicorn: connections waiting in its backlog meet the real app, none is refused in
between. A port another process holds is refused here, before anything is built or loaded.
"""

from __future__ import annotations

import errno
import http.server
import logging
import socket
import socketserver
import threading
import time

from agentjet_client.protocol import STARTING, STARTING_RETRY_S, ErrorDetail, ErrorResponse
from agentjet_server.errors import ConfigError

logger = logging.getLogger(__name__)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (IPv6 when ``host`` is one), or a ConfigError that says
    what holds the port and how to choose another."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named, not 0: asyncio sets TCP_NODELAY only on accepted sockets whose proto says TCP, and
    # without it a small answer waits for the client's delayed ACK (chat p50 6 ms -> 52 ms on loopback)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(
                f"port {port} on {host} is in use (another agentjet-server?); stop what listens there "
                f"or give this server another --port"
            ) from exc
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}; check --host and --port") from exc
    sock.listen(2048)
    return sock


class _Answer(http.server.BaseHTTPRequestHandler):
    server: _Server

    def _starting(self) -> None:
        body = ErrorResponse(error=ErrorDetail(message=self.server.owner.message(), type=STARTING)).model_dump_json()
        data = body.encode()
        self.send_response(503)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.send_header("retry-after", str(STARTING_RETRY_S))
        self.send_header("connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _starting

    def log_message(self, format: str, *args: object) -> None:
        logger.debug("while starting: " + format, *args)


class _Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    owner: StartingPort


class StartingPort:
    """Answers on ``sock`` until ``hand_over``; ``phase`` says what the start does now."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._phase = "reading its settings"
        self._since = time.monotonic()
        self._lock = threading.Lock()
        self._server = _Server(sock.getsockname()[:2], _Answer, bind_and_activate=False)
        self._server.socket.close()  # the one HTTPServer made; it answers on ours
        self._server.socket = sock
        self._server.owner = self
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.1,), daemon=True)
        self._thread.start()

    @classmethod
    def open(cls, host: str, port: int) -> StartingPort:
        return cls(bind(host, port))

    def phase(self, text: str) -> None:
        with self._lock:
            self._phase = text

    def message(self) -> str:
        with self._lock:
            phase = self._phase
        return (
            f"the server is starting: {phase} (for {_duration(time.monotonic() - self._since)}); "
            f"requests are answered once it serves, retry in {STARTING_RETRY_S} s"
        )

    def hand_over(self) -> socket.socket:
        """Stop answering; the socket, still listening, for the app's server."""
        self._server.shutdown()
        self._thread.join()
        return self.sock

    def close(self) -> None:
        """Stop answering and close the port (the start failed)."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join()
        self.sock.close()


def _duration(seconds: float) -> str:
    whole = int(seconds)
    return f"{whole // 60}m{whole % 60:02d}s" if whole >= 60 else f"{whole}s"
