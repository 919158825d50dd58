"""The port while a server starts: it listens at once, answers 503 with what the start is doing, hands
its socket to the app without refusing a connection, and a port already taken is refused up front."""

import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx2
import pytest

from agentjet_client.client import SwarmClient
from agentjet_client.errors import ServerStarting
from agentjet_client.protocol import STARTING, STARTING_RETRY_S
from agentjet_client.run.session import wait_until_serving
from agentjet_server.errors import ConfigError
from agentjet_server.starting import StartingPort
from tests.conftest import CACHE, free_port


@pytest.fixture
def starting():
    port = StartingPort.open("127.0.0.1", 0)
    yield port
    port.close()


def _url(port: StartingPort) -> str:
    return f"http://127.0.0.1:{port.sock.getsockname()[1]}"


def test_every_request_is_answered_503_with_the_phase(starting):
    starting.phase("building its embedded model: warm-up step 3/40")
    for method, path in [("GET", "/v1/status"), ("POST", "/v1/chat/completions"), ("GET", "/healthz")]:
        answer = httpx2.request(method, _url(starting) + path, json={"model": "x"} if method == "POST" else None)
        assert answer.status_code == 503, (method, path)
        assert answer.headers["retry-after"] == str(STARTING_RETRY_S)
        error = answer.json()["error"]
        assert error["type"] == STARTING
        assert error["message"].startswith("the server is starting: building its embedded model: warm-up step 3/40")
    starting.phase("loading the learner's copy of the model")
    assert "learner's copy" in httpx2.get(_url(starting) + "/v1/status").json()["error"]["message"]
    assert httpx2.head(_url(starting) + "/v1/models").status_code == 503


def test_a_client_call_says_the_server_is_starting(starting):
    with SwarmClient(_url(starting), attempts=1) as client, pytest.raises(ServerStarting) as caught:
        client.status()
    assert caught.value.status_code == 503 and "the server is starting: reading its settings" in str(caught.value)


def test_hand_over_keeps_the_port_listening(starting):
    """A connection made while the socket changes hands waits in its backlog for the app's server."""
    assert httpx2.get(_url(starting) + "/healthz").status_code == 503
    sock = starting.hand_over()
    caller = socket.create_connection(sock.getsockname()[:2], timeout=5)
    caller.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    accepted, _ = sock.accept()  # nobody else answers it now: the placeholder stopped
    with accepted, caller:
        accepted.settimeout(5)
        assert accepted.recv(100).startswith(b"GET /healthz")


def test_the_handed_over_socket_serves_without_nagle(starting):
    """asyncio turns Nagle off only on accepted sockets whose proto says TCP: off, a small answer waited for
    the caller's delayed ACK (chat p50 on loopback went from 6 ms to 52 ms)."""
    sock = starting.hand_over()
    delays: list[int] = []

    async def serve() -> None:
        def accepted(transport: asyncio.BaseTransport) -> None:
            delays.append(transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            transport.close()

        protocol = type("Accept", (asyncio.Protocol,), {"connection_made": lambda self, t: accepted(t)})
        server = await asyncio.get_running_loop().create_server(protocol, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
            for _ in range(100):
                if delays:
                    break
                await asyncio.sleep(0.01)
            writer.close()

    asyncio.run(serve())
    assert delays and delays[0] != 0, delays


def test_a_port_in_use_is_refused_with_a_way_out():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"port {port} on 127.0.0.1 is in use .*another --port"):
            StartingPort.open("127.0.0.1", port)


def test_the_client_waits_for_a_starting_server_then_runs(starting, model_dir):
    """``wait_until_serving`` tells the user what the server does, then returns the status once the
    real app (the tiny model) serves on the socket the placeholder handed over."""
    import uvicorn

    from agentjet_server.app import create_app
    from agentjet_server.engine.base import EngineOptions
    from agentjet_server.engine.hf import TransformersEngine
    from agentjet_server.settings import ServerSettings

    starting.phase("loading the model into its transformers engine")
    settings = ServerSettings(state_dir=Path(tempfile.mkdtemp(prefix="agentjet-state-")))
    app = create_app(
        TransformersEngine(model_dir, EngineOptions(model_name="agentjet-tiny")), settings, model_path=str(model_dir)
    )
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    said: list[str] = []

    def serve_later() -> None:
        while not said:  # the client has met the starting port
            time.sleep(0.05)
        server.run(sockets=[starting.hand_over()])

    thread = threading.Thread(target=serve_later, daemon=True)
    thread.start()
    try:
        with SwarmClient(_url(starting)) as client:
            status = wait_until_serving(client, say=said.append, sleep=lambda s: time.sleep(min(s, 0.1)))
        assert status.model == "agentjet-tiny"
        assert len(said) == 1 and said[0].startswith("the server is starting: loading the model"), said
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def test_agentjet_server_up_answers_while_it_starts(tmp_path):
    """The real command: from the moment it listens it answers 503 with a phase, then serves."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = (tmp_path / "server.log").open("w")
    env = {**os.environ, "AGENTJET_CACHE_DIR": str(CACHE)}
    command = [str(Path(sys.executable).parent / "agentjet-server"), "up", "--port", str(port)]
    proc = subprocess.Popen(
        [*command, "--state-dir", str(tmp_path / "state")], env=env, stdout=log, stderr=subprocess.STDOUT
    )
    phases: list[str] = []
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()
            assert time.monotonic() < deadline, (phases, (tmp_path / "server.log").read_text())
            try:
                answer = httpx2.get(url + "/v1/status", timeout=5)
            except httpx2.HTTPError:
                time.sleep(0.02)
                continue
            if answer.status_code == 200:
                break
            assert answer.status_code == 503 and answer.json()["error"]["type"] == STARTING, answer.text
            phases.append(answer.json()["error"]["message"])
            time.sleep(0.02)
        # it listened before torch loaded, so the start was seen, and its last phases too
        assert phases and all(p.startswith("the server is starting: ") for p in phases)
        assert any("loading torch" in p for p in phases), phases
        assert answer.json()["model"] == "agentjet-tiny"
        # a second server on the same port is refused before it loads anything
        second = subprocess.run(
            [*command, "--state-dir", str(tmp_path / "other")], env=env, capture_output=True, text=True, timeout=120
        )
        assert second.returncode != 0
        assert f"port {port} on 127.0.0.1 is in use" in second.stderr + second.stdout, second.stderr
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
