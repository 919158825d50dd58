"""Shared fixtures: the embedded models (shipped with the server package) and live servers on 127.0.0.1."""

from __future__ import annotations

import gc
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CACHE = Path(os.environ.get("AGENTJET_TEST_CACHE", Path(__file__).resolve().parent.parent / ".agentjet" / "test-cache"))


# one tool for tool-call tests: the embedded model's warm-up taught it the call format
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "add two numbers",
            "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
        },
    }
]


# the same tool in the Responses API's and the Messages API's shapes
RESPONSE_TOOLS = [{"type": "function", **tool["function"]} for tool in TOOLS]
MESSAGE_TOOLS = [
    {"name": f["name"], "description": f["description"], "input_schema": f["parameters"]}
    for f in (tool["function"] for tool in TOOLS)
]


@pytest.fixture(autouse=True)
def _collect_garbage_after_each_test() -> Iterator[None]:
    """A leaked socket or file warns when it is collected; collecting after every test pins the warning
    (an error here) on the test that leaked it, not on whichever test the collector happens to run in."""
    yield
    gc.collect()


def pytest_collection_finish(session: pytest.Session) -> None:
    """What importing the tests built (torch, transformers, every module: some 300,000 objects) is kept out of
    the collections after each test (``gc.freeze``): a collection walked it all, 0.15-0.7 s of CPU after every
    test, a quarter of the main suite's own CPU. What a test makes is collected after it as before."""
    gc.collect()
    gc.freeze()


def free_port() -> int:
    """A port a test server can listen on, below the kernel's ephemeral range: a port the kernel
    hands out (port 0) can be handed out again, to the outgoing connections of torchrun's
    rendezvous or gloo, before the server binds it."""
    import random

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(200):
        port = random.SystemRandom().randrange(10000, max(low, 10001))  # whatever a test seeded
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # no free port below the range: take one the kernel picks
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def model_dir() -> Path:
    from agentjet_server.embedded import ensure_embedded_model

    return ensure_embedded_model(CACHE)


@pytest.fixture(scope="session")
def tools_model_dir() -> Path:
    """The ``tools`` embedded model (``--model-size tools``), shipped prebuilt like the others."""
    from agentjet_server.embedded import ensure_embedded_model

    return ensure_embedded_model(CACHE, size="tools")


def fresh_venv(where: Path, *requirements: str) -> Path:
    """A new virtual environment at ``where`` holding ``requirements`` and what they depend on, nothing
    else; returns its python. Built by uv where the test environment has it (seconds; scripts/dev.py installs
    it), else by venv and pip."""
    import subprocess
    import sys
    import venv

    uv = Path(sys.executable).parent / "uv"
    python = where / "bin" / "python"
    if uv.exists():
        subprocess.run([str(uv), "venv", "--quiet", "--python", sys.executable, str(where)], check=True, timeout=120)
        install = [str(uv), "pip", "install", "--quiet", "--python", str(python)]
    else:
        venv.EnvBuilder(with_pip=True, clear=True).create(where)
        install = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*install, *requirements], check=True, timeout=900)
    return python


@pytest.fixture(scope="session")
def client_only_python() -> Path:
    """A second interpreter: a venv holding agentjet-client (editable) and its dependencies only
    (no numpy, no torch), for code dirs that run in their own interpreter. Built once, cached."""
    import hashlib

    package = Path(__file__).resolve().parent.parent / "packages" / "agentjet-client"
    key = hashlib.sha256((package / "pyproject.toml").read_bytes()).hexdigest()[:12]
    env_dir = CACHE / f"client-venv-{key}"
    python = env_dir / "bin" / "python"
    if not (env_dir / "ready").exists():
        building = CACHE / f"client-venv-{key}.{os.getpid()}.tmp"
        fresh_venv(building, "-e", str(package))
        (building / "ready").write_text("ok")
        try:
            building.rename(env_dir)
        except OSError:  # another session finished first: use theirs
            import shutil

            shutil.rmtree(building, ignore_errors=True)
    return python


@pytest.fixture(scope="session")
def chatty_model_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded architecture and tokenizer with fresh random weights: it rambles until
    ``max_tokens``, which is what streaming and stop-string tests need."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    target = tmp_path_factory.mktemp("chatty")
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    model.save_pretrained(target)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(target)
    return target


class LiveServer:
    """A real uvicorn server running ``create_app`` on a loopback port, in a thread."""

    def __init__(
        self,
        model_dir: Path,
        engine: object = None,
        port: int | None = None,
        name: str = "agentjet-tiny",
        **settings: object,
    ) -> None:
        import uvicorn

        from agentjet_server.app import create_app
        from agentjet_server.engine.base import EngineOptions
        from agentjet_server.engine.hf import TransformersEngine
        from agentjet_server.settings import ServerSettings

        self.port = port or free_port()
        self._own_state = "state_dir" not in settings  # made here: removed at stop (a test that reads it names one)
        settings.setdefault("state_dir", Path(tempfile.mkdtemp(prefix="agentjet-state-")))
        self.settings = ServerSettings(port=self.port, **settings)  # type: ignore[arg-type]
        self.engine = engine or TransformersEngine(model_dir, EngineOptions(model_name=name))
        self.app = create_app(self.engine, self.settings, model_path=str(model_dir))
        self.runtime = self.app.state.runtime
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "test server did not start"
            time.sleep(0.02)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        if self._own_state and not self.thread.is_alive():
            shutil.rmtree(self.settings.state_dir, ignore_errors=True)


_HTTP: list[Any] = []


def http() -> Any:
    """One HTTP client for the tests' polling (a server's start, its status): ``httpx2.get`` builds a client,
    and with it an SSL context, at every call (36 ms of CPU: a start polled 17 times, a learner waited for
    hundreds). No keep-alive: a server that is killed and another started on its port never meet a stale
    connection."""
    import httpx2

    if not _HTTP:
        _HTTP.append(httpx2.Client(timeout=60, limits=httpx2.Limits(max_keepalive_connections=0)))
    return _HTTP[0]


def wait_healthy(proc: subprocess.Popen[bytes], url: str, log: Path, limit: float, poll: float = 0.3) -> None:
    """Until ``url`` answers 200; fails with the process's log if it exits or takes over ``limit`` s."""
    import httpx2

    deadline = time.monotonic() + limit
    while True:
        assert proc.poll() is None, "server exited:\n" + log.read_text()[-4000:]
        try:
            if http().get(url).status_code == 200:
                return
        except httpx2.HTTPError:
            pass
        assert time.monotonic() < deadline, "server did not come up:\n" + log.read_text()[-4000:]
        time.sleep(poll)


def reap(proc: Any) -> None:
    """Kill a test's subprocess if it still runs and close its pipes whether or not it finished (a pipe
    left open is closed by the garbage collector in a later test, which pytest reports there)."""
    if proc is None:
        return
    if proc.poll() is None:
        proc.kill()
    proc.communicate(timeout=30)


class ServerProcess:
    """``agentjet-server up`` (or ``torchrun ... -m agentjet_server up``) as a real process on loopback."""

    def __init__(
        self,
        args: list[str],
        log: Path,
        env: dict[str, str] | None = None,
        launcher: list[str] | None = None,
        port: int | None = None,
    ) -> None:
        import subprocess
        import sys

        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        self._log = log.open("a")
        command = launcher or [str(Path(sys.executable).parent / "agentjet-server")]
        if "--state-dir" not in args:  # each server its own state unless a test shares one on purpose
            args = [*args, "--state-dir", tempfile.mkdtemp(prefix="agentjet-state-")]
        env = {**os.environ, "AGENTJET_CACHE_DIR": str(CACHE), **(env or {})}
        self.proc = subprocess.Popen(
            [*command, "up", "--port", str(self.port), *args], env=env, stdout=self._log, stderr=subprocess.STDOUT
        )
        wait_healthy(self.proc, self.url + "/healthz", log, 240)

    def status(self) -> dict:  # type: ignore[type-arg]

        return http().get(self.url + "/v1/status").json()  # type: ignore[no-any-return]

    def wait_trained(self, limit: float = 180) -> dict:  # type: ignore[type-arg]
        """The status once every accepted trajectory went through a step. The trained count moves
        after a step's weights are live, so the version read then is the last step's."""
        deadline = time.monotonic() + limit
        while True:
            status = self.status()
            counts = status["trajectories"]
            if counts["trained"] == counts["accepted"]:
                return status
            assert time.monotonic() < deadline, f"learner still busy after {limit}s: {counts}"
            time.sleep(0.3)

    def kill(self) -> None:
        """SIGKILL: no shutdown path runs (no final checkpoint, no flush)."""
        self.proc.kill()
        self.proc.wait(timeout=30)
        self._log.close()

    def stop(self) -> None:
        import subprocess

        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._log.close()


@pytest.fixture(scope="module")
def chatty_server(chatty_model_dir: Path) -> Iterator[LiveServer]:
    server = LiveServer(chatty_model_dir)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def live_server(model_dir: Path) -> Iterator[LiveServer]:
    server = LiveServer(model_dir, batch_groups=1, group_size=2, max_staleness=2)
    yield server
    server.stop()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--slow", action="store_true", help="also run the slow-marked tests (minutes each)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``slow`` tests are deselected unless ``--slow``; ``gpu`` tests are skipped, not failed, where
    CUDA is missing."""
    import torch

    if not config.getoption("--slow"):
        slow = [item for item in items if "slow" in item.keywords]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if "slow" not in item.keywords]

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def run_digits_client(url: str, episodes: int, group_size: int, *extra: str, digits: str = "3,8") -> str:
    """``agentjet-client run`` on the digits example as a real process; returns its output."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    client = str(Path(sys.executable).parent / "agentjet-client")
    command = [client, "run", "--code-dir", str(root / "examples" / "digits")]
    command += ["--server", url, "--episodes", str(episodes), "--group-size", str(group_size), "--seed", "0", *extra]
    env = {**os.environ, "AGENTJET_DIGITS": digits}
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def pytest_configure(config: pytest.Config) -> None:
    """Clients started by tests (in-process or as processes) spool under a throwaway data dir."""
    import tempfile

    os.environ["XDG_DATA_HOME"] = tempfile.mkdtemp(prefix="agentjet-test-data-")


# the skips a CI run expects: anything else that skips under CI=true fails the run, so a green CI
# cannot hide a test that never ran for want of a package or a tool (scripts/dev.py installs them)
EXPECTED_SKIPS = (
    ("tests/gpu/", "needs CUDA"),  # no GPU on CI machines
    ("tests/gpu/", "needs 2 GPUs"),
    ("tests/gpu/", "could not import 'vllm'"),  # the GPU tests' vLLM half, where vLLM is not installed
    ("tests/vllm/", "could not import 'vllm'"),  # the vLLM suite runs in its own environment (.venv-vllm)
    ("tests/server/test_cli.py", "vLLM is installed here"),  # its parsers are tested in tests/vllm then
)
_unexpected_skips: list[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if not any(report.nodeid.startswith(where) and what in reason for where, what in EXPECTED_SKIPS):
        _unexpected_skips.append(f"{report.nodeid}: {reason}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Under ``CI=true`` an unexpected skip fails the run (see ``EXPECTED_SKIPS``)."""
    if os.environ.get("CI") != "true" or not _unexpected_skips:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    lines = [
        f"{len(_unexpected_skips)} unexpected skip(s) under CI=true (install what they need, or list the skip",
        "in EXPECTED_SKIPS of tests/conftest.py if it is meant to happen in CI):",
        *_unexpected_skips,
    ]
    if reporter is not None:
        reporter.write_line("\n".join(lines), red=True)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


class ExampleService:
    """A service an example talks to (a judge endpoint, an environment server), as a real process on a free
    port: ``python SCRIPT --port P ARGS...``; up once ``probe`` answers any HTTP status."""

    def __init__(self, script: Path, *args: str, port: int | None = None, probe: str = "/") -> None:
        import subprocess
        import sys

        import httpx2

        self.port = port or free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, str(script), "--port", str(self.port), *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 90
        while True:
            try:
                http().get(self.base + probe, timeout=5)
                return
            except httpx2.TransportError:
                assert self.proc.poll() is None, f"{script.name} exited at start"
                assert time.monotonic() < deadline, f"{script.name} did not start in 90 s"
                time.sleep(0.1)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)


EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"


class RulesJudge(ExampleService):
    """The judged example's stand-in judge endpoint (``examples/judged/rules_judge.py``): an
    OpenAI-compatible chat server that stands in for a remote judge model."""

    def __init__(self, rule: str = "digits", port: int | None = None) -> None:
        super().__init__(EXAMPLES_DIR / "judged" / "rules_judge.py", "--rule", rule, port=port, probe="/calls")
        self.url = f"{self.base}/v1"

    def calls(self) -> int:

        return int(http().get(f"{self.base}/calls", timeout=5).json()["calls"])


class S3Bucket:
    """A bucket on a local S3 server (moto's server mode on 127.0.0.1): the uri of a run's prefix, the
    options file that points the store at the server, and the environment a server process needs."""

    def __init__(self, endpoint: str, bucket: str, options: Path) -> None:
        self.endpoint = endpoint
        self.bucket = bucket
        self.options = options
        self.env = {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def uri(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix}"

    def client(self):  # type: ignore[no-untyped-def]
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, **_boto_credentials())


def _boto_credentials() -> dict[str, str]:
    return {"aws_access_key_id": "testing", "aws_secret_access_key": "testing", "region_name": "us-east-1"}


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """A local S3 server (moto) for the session: its endpoint URL."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def s3_bucket(s3_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> S3Bucket:
    """A new, empty bucket on the local S3 server; the test's process has the credentials in its environment."""
    import json
    import uuid

    import boto3

    name = f"test-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_server, **_boto_credentials()).create_bucket(Bucket=name)
    options = tmp_path / "store-options.json"
    options.write_text(json.dumps({"endpoint_url": s3_server}))
    bucket = S3Bucket(s3_server, name, options)
    for key, value in bucket.env.items():
        monkeypatch.setenv(key, value)
    return bucket
