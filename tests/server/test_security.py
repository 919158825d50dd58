"""Secure defaults: who may call what, where keys come from, which turns are trained, who may read the state."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import httpx2
import pytest

from agentjet_client import SwarmClient
from agentjet_client.protocol import Trajectory
from agentjet_server.settings import ServerSettings
from tests.conftest import CACHE, LiveServer, ServerProcess, free_port

CLIENT_KEY, ADMIN_KEY = "client-key-123", "admin-key-456"
ASK = [{"role": "user", "content": "Write two as a digit."}]
CHAT = {"messages": ASK, "max_tokens": 2}


@pytest.fixture(scope="module")
def keyed_server(model_dir):
    server = LiveServer(model_dir, api_keys=[CLIENT_KEY], admin_keys=[ADMIN_KEY])
    yield server
    server.stop()


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/v1/models", None),
        ("GET", "/v1/status", None),
        ("POST", "/v1/chat/completions", CHAT),
        ("POST", "/v1/trajectories", {"trajectories": []}),
        ("GET", "/metrics", None),
        ("GET", "/v1/metrics/history", None),
        ("GET", "/v1/overview", None),
    ],
)
@pytest.mark.parametrize(
    ("authorization", "expected"),
    [
        (None, 401),
        ("", 401),
        (f"Basic {CLIENT_KEY}", 401),  # the wrong scheme
        (f"Token {CLIENT_KEY}", 401),
        ("Bearer", 401),
        ("Bearer wrong-key-000", 401),
        (f"Bearer {CLIENT_KEY}x", 401),
        (f"Bearer {CLIENT_KEY}", None),  # a client key may infer and push
        (f"bearer {ADMIN_KEY}", None),  # an admin key may do what a client key may
    ],
)
def test_every_endpoint_but_health_needs_a_valid_bearer_key(keyed_server, method, path, body, authorization, expected):
    headers = {"authorization": authorization} if authorization is not None else {}
    r = httpx2.request(method, keyed_server.url + path, json=body, headers=headers, timeout=60)
    if expected == 401:
        assert r.status_code == 401, r.text
        assert r.json()["error"]["type"] == "authentication_error"
    else:  # authorised: the request itself is judged (an empty batch is a 400, not a 401)
        assert r.status_code in (200, 400) and r.status_code != 401, r.text
    assert httpx2.get(keyed_server.url + "/healthz").status_code == 200


def sampled(url: str, task: str, seed: int | None = None) -> Trajectory:
    with SwarmClient(url, CLIENT_KEY) as client:
        episode = client.episode(task)
        episode.openai().chat.completions.create(model="agentjet-tiny", messages=ASK, max_tokens=4, seed=seed)
        episode.close()
        return episode.to_trajectory(1.0)


def push(url: str, *trajectories: Trajectory) -> list[dict]:  # type: ignore[type-arg]
    body = {"trajectories": [t.model_dump(mode="json") for t in trajectories]}
    r = httpx2.post(url + "/v1/trajectories", json=body, headers={"authorization": f"Bearer {CLIENT_KEY}"})
    assert r.status_code == 200, r.text
    return r.json()["results"]  # type: ignore[no-any-return]


def test_with_keys_only_signed_turns_are_trained_and_each_only_once(keyed_server):
    url = keyed_server.url
    good = sampled(url, "sec-1")
    assert good.turns[0].signature and good.turns[0].agent == "default"
    assert push(url, good)[0]["status"] == "accepted"

    stripped = sampled(url, "sec-1")  # a tampered turn with its signature removed is not "unsigned, fine"
    turn = stripped.turns[0]
    ids = [(turn.completion_token_ids[0] + 1) % 50, *turn.completion_token_ids[1:]]
    forged = turn.model_copy(update={"signature": None, "completion_token_ids": ids})
    result = push(url, stripped.model_copy(update={"id": "forged", "turns": [forged]}))[0]
    assert result["status"] == "rejected" and "--require-signed" in result["reason"]

    replay = good.model_copy(update={"id": "replay-1"})  # the same sample under a new id
    twice = sampled(url, "sec-2")
    both = twice.model_copy(update={"id": "replay-2", "turns": [*twice.turns, *twice.turns]})
    results = push(url, replay, both)
    assert [r["status"] for r in results] == ["rejected", "rejected"]
    assert all("already pushed" in r["reason"] for r in results)

    relabelled = sampled(url, "sec-3")  # the agent a reward goes to is signed too
    turn = relabelled.turns[0].model_copy(update={"agent": "judge"})
    result = push(url, relabelled.model_copy(update={"turns": [turn]}))[0]
    assert result["status"] == "rejected" and "not what this server sampled" in result["reason"]

    counts = httpx2.get(url + "/v1/status", headers={"authorization": f"Bearer {CLIENT_KEY}"}).json()
    reasons = counts["trajectories"]["rejected_by_reason"]
    assert reasons.get("unsigned") == 1 and reasons.get("replayed") == 2 and reasons.get("not_sampled") == 1


def test_two_episodes_that_sample_the_same_tokens_are_both_trained(keyed_server):
    first, second = sampled(keyed_server.url, "same-1", seed=11), sampled(keyed_server.url, "same-1", seed=11)
    assert first.turns[0].completion_token_ids == second.turns[0].completion_token_ids  # the very same sample
    assert first.turns[0].signature != second.turns[0].signature  # but two samplings of it
    assert [r["status"] for r in push(keyed_server.url, first, second)] == ["accepted", "accepted"]


def test_replayed_samples_stay_refused_after_a_restart(model_dir, tmp_path):
    server = LiveServer(model_dir, api_keys=[CLIENT_KEY], state_dir=tmp_path, checkpoint_every=0)
    good = sampled(server.url, "r-1")
    assert push(server.url, good)[0]["status"] == "accepted"
    server.stop()  # (its lifespan closes the runtime and the state dir)
    again = LiveServer(model_dir, api_keys=[CLIENT_KEY], state_dir=tmp_path, resume=True)
    try:
        result = push(again.url, good.model_copy(update={"id": "r-1-again"}))[0]
        assert result["status"] == "rejected" and "already pushed" in result["reason"]
    finally:
        again.stop()


def test_admin_calls_to_a_server_without_admin_keys_say_how_to_add_one(model_dir):
    server = LiveServer(model_dir, api_keys=[CLIENT_KEY])
    try:
        r = httpx2.post(server.url + "/v1/admin/pause", headers={"authorization": f"Bearer {CLIENT_KEY}"})
        error = r.json()["error"]
        assert r.status_code == 403 and error["code"] == "no_admin_keys", r.text
        assert "this server has none" in error["message"] and "AGENTJET_ADMIN_KEYS" in error["message"]
        r = httpx2.get(server.url + "/v1/status", headers={"authorization": f"Bearer {CLIENT_KEY}"})
        assert r.status_code == 200  # the client key still does what client keys do
    finally:
        server.stop()


def test_a_server_without_keys_accepts_unsigned_turns_unless_told(model_dir):
    settings = ServerSettings()
    assert not settings.signatures_required
    assert ServerSettings(require_signed=True).signatures_required
    assert not ServerSettings(api_keys=[CLIENT_KEY], require_signed=False).signatures_required


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.20", "::", "example.org"])
def test_a_reachable_host_without_a_key_is_refused(host):
    with pytest.raises(ValueError, match="--insecure"):
        ServerSettings(host=host)
    assert ServerSettings(host=host, insecure=True).host == host
    assert ServerSettings(host=host, api_keys=[CLIENT_KEY]).auth_enabled


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "127.0.0.2"])
def test_loopback_hosts_need_no_key(host):
    assert ServerSettings(host=host).host == host


def test_the_cli_refuses_a_public_host_without_a_key():
    exe = str(Path(sys.executable).parent / "agentjet-server")
    proc = subprocess.run(
        [exe, "up", "--host", "0.0.0.0", "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "AGENTJET_API_KEYS": ""},
    )
    assert proc.returncode == 2
    message = " ".join(proc.stderr.split())
    assert "--host 0.0.0.0" in message and "AGENTJET_API_KEYS" in message and "--insecure" in message


def test_keys_from_the_environment_and_a_file_stay_out_of_ps(model_dir, tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text("# client keys\nfile-key-0001\n\n")
    env = {"AGENTJET_API_KEYS": "env-key-0001,env-key-0002", "AGENTJET_CACHE_DIR": str(CACHE)}
    server = ServerProcess(
        ["--model", str(model_dir), "--api-key-file", str(key_file)], tmp_path / "server.log", env=env
    )
    try:
        command_line = Path(f"/proc/{server.proc.pid}/cmdline").read_bytes().decode()
        assert "key-0001" not in command_line and "key-0002" not in command_line
        for key in ("file-key-0001", "env-key-0001", "env-key-0002"):
            r = httpx2.get(server.url + "/v1/models", headers={"authorization": f"Bearer {key}"})
            assert r.status_code == 200, key
        assert httpx2.get(server.url + "/v1/models").status_code == 401
        assert "training only turns this server signed" in server.log_path.read_text()
    finally:
        server.stop()


def test_the_state_dir_is_readable_by_its_owner_only(model_dir, tmp_path):
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    os.chmod(state, 0o755)  # an existing, world-readable dir is made private
    server = LiveServer(model_dir, state_dir=state, batch_groups=1, group_size=2, checkpoint_every=1)
    try:
        good = sampled(server.url, "modes")  # no key: an open loopback server
        second = sampled(server.url, "modes")
        assert [r["status"] for r in push(server.url, good, second)] == ["accepted", "accepted"]
    finally:
        server.stop()
    mode = {p.relative_to(state).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in [state, *state.rglob("*")]}
    assert mode["."] == 0o700 and mode["log"] == 0o700 and mode["checkpoints"] == 0o700
    assert mode["sample.key"] == 0o600 and mode["LOCK"] == 0o600
    segments = [name for name in mode if name.startswith("log/")]
    assert segments and all(mode[name] == 0o600 for name in segments), mode
