"""A real ``agentjet-server up`` process on a free loopback port, for the benchmarks."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2


def wait_until_up(url: str) -> None:
    for _ in range(600):
        try:
            if httpx2.get(url + "/healthz").status_code == 200:
                return
        except httpx2.HTTPError:
            time.sleep(0.2)
    raise SystemExit("the server did not come up")


@contextlib.contextmanager
def served(
    model_dir: Path,
    *extra: str,
    sources: Path | None = None,
    env: dict[str, str] | None = None,
    pids: list[int] | None = None,
) -> Iterator[str]:
    """``sources``: a checkout whose packages' code the server runs instead of the installed one; ``env``:
    variables the server gets besides this process's; ``pids``: the server's process id is added to it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "agentjet_server", "up", "--port", str(port)]
    env = {**os.environ, **(env or {})}
    if sources is not None:
        paths = [str(sources / "packages" / name / "src") for name in ("agentjet-server", "agentjet-client")]
        env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")])
    command += ["--model", str(model_dir), "--model-name", "agentjet-tiny", "--log-level", "warning", *extra]
    state = tempfile.mkdtemp(prefix="agentjet-bench-state-")  # a fresh run each time
    command += ["--state-dir", state]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    if pids is not None:
        pids.append(server.pid)
    try:
        wait_until_up(url)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=30)
        shutil.rmtree(state, ignore_errors=True)
