"""``POST /v1/train/sft``: supervised updates of the served model through the API, between policy updates;
each is a step of its own (logged, served, recorded with ``mode`` "sft"); evaluation updates nothing; a
body that cannot be trained is a 400 that says what is wrong."""

from __future__ import annotations

import re

import httpx2
import pytest

from tests.conftest import LiveServer
from tests.server.learner.test_supervised import digit_chats


@pytest.fixture(scope="module")
def sft_server(model_dir):  # type: ignore[no-untyped-def]
    server = LiveServer(model_dir, batch_groups=1, group_size=2)
    yield server
    server.stop()


def post(server: LiveServer, body: dict) -> httpx2.Response:  # type: ignore[type-arg]
    return httpx2.post(server.url + "/v1/train/sft", json=body, timeout=300)


def test_supervised_updates_are_steps_served_at_once_and_evaluation_updates_nothing(sft_server):
    chats = digit_chats()
    before = post(sft_server, {"examples": chats, "evaluate": True}).json()
    again = post(sft_server, {"examples": chats, "evaluate": True}).json()
    assert before["tokens"] == 20 and again["loss"] == before["loss"]  # evaluating updated nothing
    version = httpx2.get(sft_server.url + "/v1/status").json()["policy_version"]
    for _ in range(40):
        answer = post(sft_server, {"examples": chats, "lr": 3e-3}).json()
    assert answer["mode"] == "sft" and answer["examples"] == 10 and answer["policy_version"] == version + 40
    after = post(sft_server, {"examples": chats, "evaluate": True}).json()
    assert after["loss"] < 0.5 * before["loss"], (before, after)
    # served at once: the tokens carry the new version
    ask = {"messages": chats[7]["messages"][:1], "max_tokens": 2, "temperature": 0.0}
    reply = httpx2.post(sft_server.url + "/v1/chat/completions", json=ask).json()["choices"][0]
    assert set(reply["agentjet"]["completion_versions"]) == {version + 40}
    steps = [line for line in history(sft_server) if line.get("kind") == "step"]
    assert len(steps) == 40 and {s["mode"] for s in steps} == {"sft"}
    assert steps[-1]["policy_version"] == version + 40
    # the server's own learning rate is untouched by the updates' own
    assert httpx2.get(sft_server.url + "/v1/admin/config").json()["config"]["lr"] == 1e-3
    assert {g["lr"] for g in sft_server.runtime.loop.trainer.optimizer.param_groups} == {1e-3}


def history(server: LiveServer) -> list[dict]:  # type: ignore[type-arg]
    lines = httpx2.get(server.url + "/v1/metrics/history").json()
    return lines["lines"] if isinstance(lines, dict) else lines  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"examples": digit_chats(), "epochs": 3}, 'unknown field "epochs"'),
        ({"examples": "chats.jsonl"}, "non-empty list"),
        ({"examples": [{"messages": [{"role": "user", "content": "Hi"}]}]}, "no assistant message"),
        ({"examples": digit_chats(), "lr": 5}, '"lr" must be a learning rate'),
        ({"examples": digit_chats(), "evaluate": "yes"}, '"evaluate" must be true or false'),
        ({"examples": digit_chats(), "adapter": "planner"}, "no adapter \\(it trains one model\\)"),
    ],
)
def test_bodies_that_cannot_be_trained_are_refused_with_what_is_wrong(sft_server, body, message):
    answer = post(sft_server, body)
    assert answer.status_code == 400, answer.text
    assert re.search(message, answer.json()["error"]["message"]), answer.json()
