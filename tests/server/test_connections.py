"""Connection guards on a real server process: idle and slow clients can't lock others out."""

from __future__ import annotations

import logging
import socket
import time

import httpx2
import pytest

from agentjet_server.connections import RepeatFilter
from tests.conftest import ServerProcess

pytestmark = pytest.mark.e2e


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes ``sock`` within ``seconds`` (it reads EOF, a reset, or a 503)."""
    sock.settimeout(seconds)
    try:
        while chunk := sock.recv(4096):
            if b"503" in chunk:
                return True
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


@pytest.fixture(scope="module")
def guarded(model_dir, tmp_path_factory):
    args = ["--model", str(model_dir), "--max-connections", "24", "--header-timeout", "1.5"]
    server = ServerProcess(args, tmp_path_factory.mktemp("guarded") / "server.log")
    yield server
    server.stop()


def test_idle_connections_are_pushed_out_by_new_clients(guarded):
    idle = [socket.create_connection(("127.0.0.1", guarded.port)) for _ in range(60)]
    try:
        for _ in range(5):  # new clients get in: the longest-idle connections make room
            assert httpx2.get(guarded.url + "/healthz", timeout=5).status_code == 200
        closed = sum(closed_within(s, 0.5) for s in idle[:10])
        assert closed == 10  # the oldest were closed (pushed out, or timed out waiting for headers)
    finally:
        for s in idle:
            s.close()


def test_a_client_that_trickles_its_headers_is_disconnected(guarded):
    slow = socket.create_connection(("127.0.0.1", guarded.port))
    try:
        slow.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # never the blank line that ends the headers
        started = time.monotonic()
        for _ in range(4):
            time.sleep(0.3)
            slow.sendall(b"X-Slow: 1\r\n")
        assert closed_within(slow, 5.0)
        assert time.monotonic() - started < 5.0
    finally:
        slow.close()
    assert httpx2.get(guarded.url + "/healthz").status_code == 200


def test_a_repeated_log_line_is_written_once_then_counted():
    records = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    log = logging.getLogger("agentjet-test-repeat")
    log.addHandler(handler)
    log.propagate = False
    repeat = RepeatFilter(every=0.2)
    log.addFilter(repeat)
    try:
        for _ in range(1000):
            log.error("accept failed: %s", "too many open files")
        time.sleep(0.25)
        log.error("accept failed: %s", "too many open files")
    finally:
        log.removeHandler(handler)
        log.removeFilter(repeat)
    assert len(records) == 2
    assert "and 999 more like it" in records[1].getMessage()
