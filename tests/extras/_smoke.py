"""What the extras' smoke checks share. Each check runs in a fresh environment that holds one package with
one extra (``scripts/extras.py`` builds it), so this module uses the standard library only."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def server_url() -> str:
    """The AgentJet server the orchestrator started for the client checks (a real one, from .venv)."""
    return os.environ["AGENTJET_SMOKE_SERVER"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def post(url: str, body: dict[str, Any], timeout: float = 120) -> dict[str, Any]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        answer: dict[str, Any] = json.loads(reply.read())
        return answer


def get(url: str, timeout: float = 30) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        answer: dict[str, Any] = json.loads(reply.read())
        return answer


def wait_for(url: str, proc: subprocess.Popen[bytes], log: Path, limit: float = 240) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"{url}: the process exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.3)
    proc.kill()
    sys.exit(f"{url} did not answer within {limit:.0f} s:\n{log.read_text()[-3000:]}")


class Server:
    """``agentjet-server up`` of this environment on a loopback port (the embedded tiny model)."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        work = Path(tempfile.mkdtemp(prefix="agentjet-smoke-"))
        self.log = work / "server.log"
        command = [str(BIN / "agentjet-server"), "up", "--port", str(self.port), "--state-dir", str(work / "state")]
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [*command, *args], stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
            )
        wait_for(self.url + "/healthz", self.proc, self.log)

    def chat(self, **body: Any) -> dict[str, Any]:
        ask = [{"role": "user", "content": "Write seven as a digit."}]
        return post(self.url + "/v1/chat/completions", {"messages": ask, "max_tokens": 8, **body})

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class Collector:
    """An OTLP/HTTP endpoint on loopback that keeps the bodies posted to it."""

    def __init__(self) -> None:
        bodies: list[tuple[str, bytes]] = []
        self.bodies = bodies

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                bodies.append((self.path, self.rfile.read(int(self.headers.get("Content-Length", 0)))))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def wait(self, wanted: bytes, limit: float = 60) -> None:
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            if any(path == "/v1/traces" and wanted in body for path, body in self.bodies):
                return
            time.sleep(0.2)
        sys.exit(f"no span {wanted!r} reached the OTLP endpoint in {limit:.0f} s ({len(self.bodies)} posts)")


def try_example(name: str, env: dict[str, str] | None = None) -> str:
    """``agentjet-client try`` on ``examples/NAME`` against the orchestrator's server: one real episode."""
    command = [str(BIN / "agentjet-client"), "try", "--code-dir", str(ROOT / "examples" / name)]
    command += ["--server", server_url(), "--timeout", "120"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})})
    if done.returncode != 0:
        sys.exit(
            f"agentjet-client try on examples/{name} exited {done.returncode}:\n{done.stdout[-3000:]}{done.stderr}"
        )
    return done.stdout
