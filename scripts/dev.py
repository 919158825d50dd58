#!/usr/bin/env python3
"""Set up a virtual environment and run the demo or the tests. Needs only Python 3.11+.

    python3 scripts/dev.py demo    # server with the embedded model + a client that trains it
    python3 scripts/dev.py test    # the whole test suite

The environment lives in .venv (reused when it is already set up). torch is pinned to the CPU
build 2.13.0 here; the packages themselves accept a range.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"
BIN = VENV / "bin"
STAMP = VENV / ".agentjet-installed"
REQUIREMENTS = ["torch==2.13.0", "pytest>=8"]


def sh(*cmd: str, **kw: object) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kw)  # type: ignore[call-overload]


def ensure_env() -> None:
    wanted = (
        "\n".join(REQUIREMENTS) + "\n" + "".join(p.read_text() for p in sorted(ROOT.glob("packages/*/pyproject.toml")))
    )
    if STAMP.exists() and STAMP.read_text() == wanted:
        return
    print("setting up .venv (first run only: a few minutes)", flush=True)
    if not (BIN / "python").exists():
        venv.EnvBuilder(with_pip=True).create(VENV)
    pip = [str(BIN / "python"), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    sh(*pip, *REQUIREMENTS)
    sh(*pip, "-e", str(ROOT / "packages" / "agentjet-client"), "-e", str(ROOT / "packages" / "agentjet-server"))
    STAMP.write_text(wanted)


def wait_healthy(url: str, proc: subprocess.Popen[bytes], limit: float = 300.0) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit("the server exited during start-up; see its output above")
        try:
            with urllib.request.urlopen(url + "/healthz", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    sys.exit(f"the server did not answer on {url} within {limit:.0f}s")


def demo(port: int = 8765, episodes: int = 26000) -> None:
    ensure_env()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([str(BIN / "agentjet-server"), "up", "--port", str(port), "--log-level", "warning"])
    try:
        wait_healthy(url, server)
        sh(
            str(BIN / "agentjet-client"),
            "run",
            "--code-dir",
            str(ROOT / "examples" / "digits"),
            "--server",
            url,
            "--episodes",
            str(episodes),
            "--seed",
            "0",
        )
    finally:
        server.terminate()
        server.wait(timeout=30)


def test(extra: list[str]) -> None:
    ensure_env()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([str(BIN / "python"), "-m", "pytest", *extra], cwd=ROOT, env=env)
    sys.exit(result.returncode)


def main() -> None:
    args = sys.argv[1:]
    if not args or args[0] not in ("demo", "test", "setup"):
        sys.exit(__doc__)
    if args[0] == "demo":
        demo()
    elif args[0] == "setup":
        ensure_env()
    else:
        test(args[1:])


if __name__ == "__main__":
    main()
