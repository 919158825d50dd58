"""``POST /v1/train/sft`` and ``/v1/train/dpo``: supervised and preference updates of the served model through
the API, between policy updates; each is a step of its own (logged, served, recorded with its ``mode``);
evaluation updates nothing; a body that cannot be trained is a 400 that says what is wrong."""

from __future__ import annotations

import re

import httpx2
import pytest

from tests.conftest import LiveServer
from tests.server.learner.test_preference import digit_pairs
from tests.server.learner.test_supervised import digit_chats


@pytest.fixture(scope="module")
def sft_server(model_dir):  # type: ignore[no-untyped-def]
    server = LiveServer(model_dir, batch_groups=1, group_size=2)
    yield server
    server.stop()


def post(server: LiveServer, body: dict, mode: str = "sft") -> httpx2.Response:  # type: ignore[type-arg]
    return httpx2.post(server.url + f"/v1/train/{mode}", json=body, timeout=300)


def test_supervised_updates_are_steps_served_at_once_and_evaluation_updates_nothing(sft_server):
    chats = digit_chats()
    before = post(sft_server, {"examples": chats, "evaluate": True}).json()
    again = post(sft_server, {"examples": chats, "evaluate": True}).json()
    assert before["tokens"] == 20 and again["loss"] == before["loss"]  # evaluating updated nothing
    version = httpx2.get(sft_server.url + "/v1/status").json()["policy_version"]
    for _ in range(40):
        answer = post(sft_server, {"examples": chats, "lr": 3e-3}).json()
    assert answer["mode"] == "sft" and answer["examples"] == 10 and answer["policy_version"] == version + 40
    learner = httpx2.get(sft_server.url + "/v1/status").json()["learner"]  # a step without episodes: no reward
    assert learner["last_mean_reward"] is None and learner["last_loss"] == pytest.approx(answer["loss"], rel=1e-3)
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


def test_dpo_scores_pairs_then_orders_them_in_steps_of_its_own(sft_server):
    pairs = digit_pairs()
    scored = post(sft_server, {"pairs": pairs, "evaluate": True}, "dpo").json()
    assert scored["pairs"] == 10 and len(scored["chosen_logps"]) == len(scored["rejected_logps"]) == 10
    assert "reward_margin" not in scored  # no reference log-probs yet: nothing to measure a margin against
    referenced = [
        {**pair, "ref_chosen_logps": c, "ref_rejected_logps": r}
        for pair, c, r in zip(pairs, scored["chosen_logps"], scored["rejected_logps"], strict=True)
    ]
    at_start = post(sft_server, {"pairs": referenced, "evaluate": True}, "dpo").json()
    assert at_start["reward_margin"] == pytest.approx(0, abs=1e-4) and at_start["loss"] == pytest.approx(
        0.6931, abs=1e-3
    )
    version = httpx2.get(sft_server.url + "/v1/status").json()["policy_version"]
    for _ in range(8):
        answer = post(sft_server, {"pairs": referenced, "beta": 0.5, "lr": 3e-3}, "dpo").json()
    assert answer["mode"] == "dpo" and answer["pairs"] == 10 and answer["policy_version"] == version + 8
    after = post(sft_server, {"pairs": referenced, "evaluate": True, "beta": 0.5}, "dpo").json()
    assert after["accuracy"] == 1.0 and after["reward_margin"] > 0.5 and after["logp_margin"] > scored["logp_margin"]
    steps = [line for line in history(sft_server) if line.get("kind") == "step"]
    assert [s["mode"] for s in steps[-8:]] == ["dpo"] * 8 and steps[-1]["reward_margin"] > steps[-8]["reward_margin"]
    metrics = httpx2.get(sft_server.url + "/metrics").text
    assert re.search(r'agentjet_learner_steps_by_mode_total\{mode="dpo"\} [1-9]', metrics), metrics[:2000]
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


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"examples": digit_chats()}, 'unknown field "examples"'),
        ({"pairs": digit_pairs()}, "ref_chosen_logps"),
        ({"pairs": digit_pairs(), "evaluate": True, "beta": 0}, '"beta" must be a number above 0'),
        ({"pairs": [{"prompt": "Hi", "chosen": "1", "rejected": "1"}], "evaluate": True}, "the same"),
    ],
)
def test_dpo_bodies_that_cannot_be_trained_are_refused_with_what_is_wrong(sft_server, body, message):
    answer = post(sft_server, body, "dpo")
    assert answer.status_code == 400, answer.text
    assert re.search(message, answer.json()["error"]["message"]), answer.json()
