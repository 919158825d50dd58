"""The client image's entrypoint (``deploy/client/entrypoint.sh``), run outside a container: a swarm client
configured by environment variables alone (the server too), the key from a mounted file and never in the process's
arguments, JSON log lines with the episode's ids, a heartbeat for the health check, and SIGTERM ending a run as
Ctrl-C does. Wrong environments are refused with what to set."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx2
import pytest

from tests.conftest import ServerProcess, reap

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
ENTRYPOINT = ROOT / "deploy" / "client" / "entrypoint.sh"
KEY = "client-key-from-a-secret"
AGENT = """
import logging

from agentjet_client import swarm_agent

log = logging.getLogger("agent")


@swarm_agent(tasks=[{"id": f"digit-{d}", "word": w, "answer": str(d)} for d, w in ((3, "three"), (8, "eight"))])
async def write_digit(task, episode):
    log.warning("playing %s", task["id"])
    reply = await episode.async_openai().chat.completions.create(
        model="agentjet-tiny", messages=[{"role": "user", "content": f"Write {task['word']} as a digit."}], max_tokens=4
    )
    return 1.0 if (reply.choices[0].message.content or "").strip() == task["answer"] else 0.0
"""


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A server configured by its environment only (the port and state dir aside), JSON log lines."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    env = {
        "AGENTJET_API_KEYS": KEY,
        "AGENTJET_SERVER_GROUP_SIZE": "4",
        "AGENTJET_SERVER_BATCH_GROUPS": "1",
        "AGENTJET_SERVER_LOG_FORMAT": "json",
    }
    server = ServerProcess([], log, env=env)
    yield server
    server.stop()


def client_env(tmp_path: Path, server_url: str, **extra: str) -> dict[str, str]:
    (tmp_path / "agent").mkdir(exist_ok=True)
    (tmp_path / "agent" / "agent.py").write_text(AGENT)
    (tmp_path / "key").write_text(KEY + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTJET_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(
        AGENTJET_CLIENT_SERVER=server_url,
        AGENTJET_CLIENT_CODE_DIR=str(tmp_path / "agent"),
        AGENTJET_CLIENT_API_KEY_FILE=str(tmp_path / "key"),
        AGENTJET_CLIENT_SPOOL_DIR=str(tmp_path / "spool"),
        AGENTJET_CLIENT_HEARTBEAT_FILE=str(tmp_path / "heartbeat"),
        AGENTJET_CLIENT_LOG_FORMAT="json",
        AGENTJET_CLIENT_CONCURRENCY="4",
        **extra,
    )
    return env


def status(server: ServerProcess) -> dict:  # type: ignore[type-arg]
    return httpx2.get(server.url + "/v1/status", headers={"Authorization": f"Bearer {KEY}"}).json()  # type: ignore[no-any-return]


def test_a_client_configured_by_its_environment_alone_trains_the_server(keyed_server, tmp_path):
    before = status(keyed_server)["trajectories"]["accepted"]
    env = client_env(tmp_path, keyed_server.url, AGENTJET_CLIENT_EPISODES="16")
    proc = subprocess.Popen(["sh", str(ENTRYPOINT)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "heartbeat").exists():  # running: `exec` made the shell the client itself
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        arguments = Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")
        assert b"agentjet-client" in b" ".join(arguments) and KEY.encode() not in b" ".join(arguments)
        health = subprocess.run(
            [sys.executable, str(ROOT / "deploy" / "client" / "healthcheck.py")], env=env, timeout=30
        )
        assert health.returncode == 0
        out, err = proc.communicate(timeout=300)
    finally:
        reap(proc)
    assert proc.returncode == 0, out[-2000:] + err[-2000:]
    after = status(keyed_server)
    assert after["trajectories"]["accepted"] - before == 16 and after["learner"]["group_size"] == 4
    lines = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    played = [line for line in lines if line["message"].startswith("playing digit-")]
    assert len(played) == 16, err[-2000:]
    assert all(line["episode_id"] and line["trajectory_id"] == line["episode_id"] for line in played)
    assert {line["run_id"] for line in played} == {after["run_id"]}  # the server's run
    assert {line["task_id"] for line in played} == {"digit-3", "digit-8"}
    assert len({line["episode_id"] for line in played}) == 16
    server_lines = [json.loads(line) for line in keyed_server.log_path.read_text().splitlines() if line.startswith("{")]
    assert server_lines and all(set(line) >= {"ts", "level", "message", "run_id"} for line in server_lines)
    assert {line["run_id"] for line in server_lines if line["run_id"]} == {after["run_id"]}


def test_sigterm_ends_a_run_as_ctrl_c_does(keyed_server, tmp_path):
    env = client_env(tmp_path, keyed_server.url, AGENTJET_CLIENT_EPISODES="0")  # until stopped
    proc = subprocess.Popen(["sh", str(ENTRYPOINT)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        before = status(keyed_server)["trajectories"]["accepted"]
        deadline = time.monotonic() + 120
        while status(keyed_server)["trajectories"]["accepted"] < before + 8:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        reap(proc)
    assert proc.returncode == 0 and "interrupted" in err, out[-2000:] + err[-2000:]  # the run's report, as after Ctrl-C


@pytest.mark.parametrize(
    ("change", "args", "message"),
    [
        ({}, ["--api-key", KEY], "the API key is not taken as an argument"),
        ({"AGENTJET_CLIENT_SERVER": ""}, [], "set AGENTJET_CLIENT_SERVER to the server's URL"),
        ({"AGENTJET_CLIENT_CODE_DIR": ""}, [], "set AGENTJET_CLIENT_CODE_DIR to the agent's directory"),
        ({"AGENTJET_CLIENT_API_KEY_FILE": "/no/such/key"}, [], "cannot be read; mount the Secret there"),
        ({"AGENTJET_CLIENT_EPISODES": "many"}, [], "Invalid value for '--episodes'"),
    ],
)
def test_a_wrong_environment_is_refused_with_what_to_set(tmp_path, change, args, message):
    env = {**client_env(tmp_path, "http://127.0.0.1:9"), **change}
    proc = subprocess.run(["sh", str(ENTRYPOINT), *args], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and message in proc.stdout + proc.stderr, proc.stdout + proc.stderr
