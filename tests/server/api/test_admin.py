"""The admin API: roles, live configuration (logged, restored by --resume), pause, checkpoint,
stop, clients; and evaluation episodes, which are recorded and never trained."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx2
import pytest

from agentjet_client import SwarmClient
from agentjet_client.protocol import ClientReport, Trajectory
from agentjet_server.ingest.wal import Configured, Evaluated, read_records
from tests.conftest import LiveServer, ServerProcess

CLIENT_KEY, ADMIN_KEY = "client-key-123", "admin-key-456"
ASK = [{"role": "user", "content": "Write two as a digit."}]
ADMIN_ROUTES = [
    ("GET", "/v1/admin/config", None),
    ("PATCH", "/v1/admin/config", {"max_staleness": 3}),
    ("POST", "/v1/admin/pause", None),
    ("POST", "/v1/admin/resume", None),
    ("POST", "/v1/admin/checkpoint", None),
    ("GET", "/v1/admin/clients", None),
]


def sampled(url: str, task: str, reward: float, key: str | None = None, purpose: str = "train") -> Trajectory:
    with SwarmClient(url, key) as client:
        episode = client.episode(task, purpose=purpose)  # type: ignore[arg-type]
        episode.openai().chat.completions.create(model="agentjet-tiny", messages=ASK, max_tokens=3)
        episode.close()
        return episode.to_trajectory(reward)


def push(url: str, trajectories: list[Trajectory], key: str | None = None, report: ClientReport | None = None) -> list:  # type: ignore[type-arg]
    with SwarmClient(url, key) as client:
        return [r.status for r in client.submit(trajectories, report).results]


def group(url: str, task: str, key: str | None = None) -> list[Trajectory]:
    """A GRPO group of two with a reward signal (one right, one wrong)."""
    return [sampled(url, task, 1.0, key), sampled(url, task, 0.0, key)]


def wait_for(condition, timeout: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def admin(url: str, method: str, path: str, body: dict | None = None, key: str | None = None) -> httpx2.Response:  # type: ignore[type-arg]
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx2.request(method, url + path, json=body, headers=headers, timeout=120)


def test_admin_routes_answer_401_without_a_key_403_to_a_client_key_200_to_an_admin_key(model_dir, tmp_path):
    env = {"AGENTJET_API_KEYS": CLIENT_KEY, "AGENTJET_ADMIN_KEYS": ADMIN_KEY}
    state = tmp_path / "state"
    server = ServerProcess(
        ["--batch-groups", "1", "--group-size", "2", "--state-dir", str(state)], tmp_path / "s.log", env=env
    )
    try:
        refused_only = [("POST", "/v1/admin/stop", None), ("POST", "/v1/admin/adopt", {"checkpoint": str(state)})]
        for method, path, body in [*ADMIN_ROUTES, *refused_only]:
            assert admin(server.url, method, path, body).status_code == 401, path
            r = admin(server.url, method, path, body, CLIENT_KEY)
            assert r.status_code == 403 and "admin key" in r.json()["error"]["message"], (path, r.text)
        assert push(server.url, group(server.url, "t0", CLIENT_KEY), CLIENT_KEY) == ["accepted", "accepted"]
        for method, path, body in ADMIN_ROUTES:
            r = admin(server.url, method, path, body, ADMIN_KEY)
            assert r.status_code == 200, (path, r.text)
        assert admin(server.url, "GET", "/metrics", key=CLIENT_KEY).status_code == 200  # reading is for clients too
        checkpoint = admin(server.url, "POST", "/v1/admin/checkpoint", key=ADMIN_KEY).json()
        assert Path(checkpoint["path"], "model", "config.json").exists()
        stopped = admin(server.url, "POST", "/v1/admin/stop", key=ADMIN_KEY)
        assert stopped.status_code == 200, stopped.text
        assert server.proc.wait(timeout=60) == 0  # a clean exit
        step = stopped.json()["checkpoint"]["step"]
        assert (state / "checkpoints" / f"step-{step:08d}" / "state.json").exists()
    finally:
        server.stop()


def test_a_learning_rate_change_applies_from_the_next_step_and_survives_resume(model_dir, tmp_path):
    state = tmp_path / "state"
    server = LiveServer(model_dir, batch_groups=1, group_size=2, lr=1e-3, state_dir=state)
    try:
        learner = server.runtime.loop.learner
        push(server.url, group(server.url, "t0"))
        wait_for(lambda: learner.steps == 1)
        r = admin(server.url, "PATCH", "/v1/admin/config", {"lr": 2.5e-4, "max_staleness": 2})
        assert r.status_code == 200, r.text
        change = r.json()["changes"][-1]
        assert change["changes"] == {"lr": 2.5e-4, "max_staleness": 2} and change["previous"]["lr"] == 1e-3
        assert change["step"] == 1
        assert server.runtime.store.max_staleness == 2  # at once
        push(server.url, group(server.url, "t1"))
        wait_for(lambda: learner.steps == 2)
        assert [g["lr"] for g in learner.optimizer.param_groups] == [2.5e-4]  # the step after the change
        history = httpx2.get(server.url + "/v1/metrics/history?kind=config").json()["lines"]
        assert history[-1]["changes"] == {"lr": 2.5e-4, "max_staleness": 2}
        logged = [r for r in read_records(state / "log") if isinstance(r, Configured)]
        assert logged[-1].live == {"lr": 2.5e-4, "max_staleness": 2}  # durable before it was answered
    finally:
        server.stop()
    # the shutdown checkpoint compacted that log segment: the checkpoint carries the change on
    newest = sorted((state / "checkpoints").glob("step-*"))[-1]
    assert json.loads((newest / "state.json").read_text())["live"] == {"lr": 2.5e-4, "max_staleness": 2}

    resumed = LiveServer(model_dir, batch_groups=1, group_size=2, lr=1e-3, state_dir=state, resume=True)
    try:
        config = admin(resumed.url, "GET", "/v1/admin/config").json()
        assert config["config"]["lr"] == 2.5e-4 and config["config"]["max_staleness"] == 2
        assert [g["lr"] for g in resumed.runtime.loop.learner.optimizer.param_groups] == [2.5e-4]
        push(resumed.url, group(resumed.url, "t2"))
        wait_for(lambda: resumed.runtime.loop.learner.steps == 3)
        assert [g["lr"] for g in resumed.runtime.loop.learner.optimizer.param_groups] == [2.5e-4]

        def steps() -> list[int]:
            lines = httpx2.get(resumed.url + "/v1/metrics/history?kind=step").json()["lines"]
            return [x["step"] for x in lines]

        wait_for(lambda: steps() == [1, 2, 3])  # the history of the run before the restart is kept
    finally:
        resumed.stop()


def test_while_paused_no_step_is_taken_and_serving_goes_on(model_dir, tmp_path):
    state = tmp_path / "state"
    server = LiveServer(model_dir, batch_groups=1, group_size=2, state_dir=state)
    try:
        assert admin(server.url, "POST", "/v1/admin/pause").json()["paused"] is True
        for task in ("t0", "t1", "t2"):
            assert push(server.url, group(server.url, task)) == ["accepted", "accepted"]  # ingestion goes on
        time.sleep(2.0)
        status = httpx2.get(server.url + "/v1/status").json()
        assert status["paused"] and status["learner"]["step"] == 0 and status["trajectories"]["buffered"] == 6
        assert "agentjet_learner_paused 1.0" in httpx2.get(server.url + "/metrics").text
    finally:
        server.stop()
    resumed = LiveServer(model_dir, batch_groups=1, group_size=2, state_dir=state, resume=True)
    try:
        time.sleep(1.5)
        status = httpx2.get(resumed.url + "/v1/status").json()
        assert status["paused"] and status["learner"]["step"] == 0  # still paused after the restart
        assert admin(resumed.url, "POST", "/v1/admin/resume").json()["paused"] is False
        wait_for(lambda: resumed.runtime.loop.learner.steps == 3)
    finally:
        resumed.stop()


@pytest.mark.parametrize(
    ("changes", "named", "message"),
    [
        ({"nonsense": 1}, "nonsense", "not a setting of this server"),
        ({"model": "/tmp/x"}, "model", "cannot be changed while the server runs"),
        ({"lr": -1}, "lr", "greater than 0"),
        ({"group_size": "many"}, "group_size", "valid integer"),
    ],
)
def test_config_changes_that_cannot_apply_are_400s_naming_the_setting(live_server, changes, named, message):
    r = admin(live_server.url, "PATCH", "/v1/admin/config", changes)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == named and message in error["message"], error


def test_clients_report_their_spool_depth_with_each_push(live_server):
    trajectory = sampled(live_server.url, "t-clients", 0.0)
    report = ClientReport(id="laptop-7", spool_depth=12, episodes=40, running=3, code_version="abc")
    push(live_server.url, [trajectory], report=report)
    clients = {c["id"]: c for c in admin(live_server.url, "GET", "/v1/admin/clients").json()["clients"]}
    me = clients["laptop-7"]
    assert (me["spool_depth"], me["episodes"], me["running"], me["code_version"]) == (12, 40, 3, "abc")
    assert me["accepted"] == 1 and time.time() - me["last_seen"] < 60
    assert 'agentjet_client_spool_depth{client="laptop-7"} 12.0' in httpx2.get(live_server.url + "/metrics").text


def test_an_evaluation_episode_never_reaches_the_learner(model_dir, tmp_path):
    state = tmp_path / "state"
    server = LiveServer(model_dir, batch_groups=1, group_size=2, state_dir=state)
    try:
        evals = [sampled(server.url, "t-eval", r, purpose="eval") for r in (1.0, 0.0, 1.0, 0.0)]
        assert push(server.url, evals) == ["accepted"] * 4  # two full "groups" with a signal, if they were trained
        time.sleep(1.5)
        status = httpx2.get(server.url + "/v1/status").json()
        counts = status["trajectories"]
        assert counts["evaluated"] == 4 and counts["accepted"] == 0 and counts["buffered"] == 0
        assert status["learner"]["step"] == 0 and counts["trained"] == 0
        assert push(server.url, evals[:1]) == ["duplicate"]
        # its sample can't be trained later under another id either
        replay = evals[0].model_copy(update={"id": "another-id", "purpose": "train"})
        assert push(server.url, [replay]) == ["rejected"]
        lines = httpx2.get(server.url + "/v1/metrics/history?kind=eval").json()["lines"]
        assert sorted(x["reward"] for x in lines) == [0.0, 0.0, 1.0, 1.0]
        assert {x["policy_version"] for x in lines} == {0}
        assert push(server.url, group(server.url, "t-train")) == ["accepted", "accepted"]
        wait_for(lambda: server.runtime.loop.learner.steps == 1)
    finally:
        server.stop()
    assert sum(isinstance(r, Evaluated) for r in read_records(state / "log", compacted=True)) == 4
    resumed = LiveServer(model_dir, batch_groups=1, group_size=2, state_dir=state, resume=True)
    try:
        counts = httpx2.get(resumed.url + "/v1/status").json()["trajectories"]
        assert counts["evaluated"] == 4 and counts["buffered"] == 0  # not replayed into the buffer
        assert push(resumed.url, evals[1:2]) == ["duplicate"]
    finally:
        resumed.stop()


def test_the_objective_changes_live_and_a_kl_penalty_needs_a_reference_from_the_start(model_dir):
    server = LiveServer(model_dir, batch_groups=1, group_size=2)
    try:
        loop = server.runtime.loop
        r = admin(server.url, "PATCH", "/v1/admin/config", {"off_policy": "tis", "stale_policy": "downweight"})
        assert r.status_code == 200, r.text
        assert loop.stale_policy == "downweight"  # at once: the next batch is built with it
        push(server.url, group(server.url, "t0"))
        wait_for(lambda: loop.learner.steps == 1)
        assert loop.learner.config.off_policy == "tis"
        r = admin(server.url, "PATCH", "/v1/admin/config", {"kl_coef": 0.1})
        assert r.status_code == 400 and "no reference model" in r.json()["error"]["message"], r.text
        r = admin(server.url, "PATCH", "/v1/admin/config", {"off_policy": "naive"})
        assert r.status_code == 400 and "off_policy" in r.json()["error"]["message"], r.text
        assert admin(server.url, "GET", "/v1/admin/config").json()["config"]["kl_coef"] == 0.0
    finally:
        server.stop()


def served_logprobs(url: str) -> list[float]:
    """The served policy's greedy log-probs on a fixed prompt (what a client samples from)."""
    body = {"model": "agentjet-tiny", "messages": ASK, "max_tokens": 4, "temperature": 0, "logprobs": True}
    answer = httpx2.post(url + "/v1/chat/completions", json=body, timeout=60).json()
    return [t["logprob"] for t in answer["choices"][0]["logprobs"]["content"]]


def test_a_server_adopts_another_runs_checkpoint_keeping_its_own_settings_and_step(model_dir, tmp_path):
    """Population-based training's exploit: B takes A's checkpoint (weights and optimizer state) through
    the admin API; B serves A's policy as a new version, keeps its own learning rate and step count, and
    a restart of B continues from the adopted weights. Bad sources are 400s that say what to give."""
    a = LiveServer(model_dir, batch_groups=1, group_size=2, lr=5e-2, state_dir=tmp_path / "a")
    b = LiveServer(model_dir, batch_groups=1, group_size=2, lr=1e-4, state_dir=tmp_path / "b")
    try:
        for task in ("t0", "t1"):
            push(a.url, group(a.url, task))
        wait_for(lambda: a.runtime.loop.learner.steps == 2)
        push(b.url, group(b.url, "t0"))
        wait_for(lambda: b.runtime.loop.learner.steps == 1)
        donor = admin(a.url, "POST", "/v1/admin/checkpoint").json()
        assert served_logprobs(a.url) != served_logprobs(b.url)  # lr 5e-2 moved A's policy
        version = httpx2.get(b.url + "/v1/status").json()["policy_version"]

        r = admin(b.url, "POST", "/v1/admin/adopt", {"checkpoint": str(tmp_path / "a")})  # a state dir: its newest
        assert r.status_code == 200, r.text
        info = r.json()
        assert info["source"] == donor["path"] and info["source_step"] == 2
        assert info["policy_version"] == version + 1 and info["step"] == 1
        assert served_logprobs(b.url) == pytest.approx(served_logprobs(a.url), abs=1e-5)
        learner = b.runtime.loop.learner
        assert learner.steps == 1 and [g["lr"] for g in learner.optimizer.param_groups] == [1e-4]
        assert Path(info["checkpoint"], "state.json").exists()
        adopted = httpx2.get(b.url + "/v1/metrics/history?kind=adopt").json()["lines"]
        assert adopted[-1]["source"] == donor["path"] and adopted[-1]["policy_version"] == version + 1
        push(b.url, group(b.url, "t1"))  # B trains on from there with its own settings
        wait_for(lambda: learner.steps == 2)

        for body, message in [
            ({}, "give the checkpoint to take"),
            ({"checkpoint": str(tmp_path / "nowhere")}, "does not exist"),
            ({"checkpoint": str(tmp_path)}, "neither a checkpoint"),
            ({"checkpoint": str(tmp_path / "a"), "lr": 1}, "unknown field 'lr'"),
        ]:
            r = admin(b.url, "POST", "/v1/admin/adopt", body)
            assert r.status_code == 400 and message in r.json()["error"]["message"], (body, r.text)
        (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
        r = admin(b.url, "POST", "/v1/admin/adopt", {"checkpoint": str(tmp_path / "empty")})
        assert r.status_code == 400 and "no complete checkpoint" in r.json()["error"]["message"], r.text
        expected = served_logprobs(b.url)
    finally:
        a.stop()
        b.stop()
    resumed = LiveServer(model_dir, batch_groups=1, group_size=2, lr=1e-4, state_dir=tmp_path / "b", resume=True)
    try:
        assert served_logprobs(resumed.url) == pytest.approx(expected, abs=1e-5)
    finally:
        resumed.stop()


def test_a_checkpoint_of_another_model_or_adapter_is_refused_before_anything_is_loaded(live_server):
    from agentjet_server.learner.resume import check_donor

    learner = live_server.runtime.loop.learner
    weights = {k: v.clone() for k, v in learner.full_state_dict().items()}
    name = next(iter(weights))
    for state, message in [
        ({"weights": {**weights, name: weights[name][:1]}}, f"{name} is"),
        ({"weights": {**weights, "lm_head.extra": weights[name]}}, "has no weight lm_head.extra"),
        ({"weights": weights, "lora": {"rank": 4, "alpha": 8.0, "dropout": 0.0, "targets": ["q_proj"]}}, "LoRA"),
    ]:
        with pytest.raises(ValueError, match=message):
            check_donor(learner.model, learner.policy, learner.lora, state)
    check_donor(learner.model, learner.policy, learner.lora, {"weights": weights})
