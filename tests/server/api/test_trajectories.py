"""Pushing trajectories: each is answered accepted, duplicate, stale or invalid (with the reason); a bad batch
is a 400 that says what is wrong."""

from __future__ import annotations

import httpx2
import pytest

from agentjet_client.protocol import Trajectory, Turn
from tests.server.api.calls import post

ASK = [{"role": "user", "content": "What is 2 + 3?"}]


def test_trajectory_results_accept_duplicate_stale_invalid(live_server, sdk):
    rt = live_server.runtime
    version, step = rt.loop.live
    rt.loop.live = (version + 10, step)  # pretend the learner has moved on 10 versions
    try:
        fresh_turn = real_turn(live_server, sdk).model_copy(update={"policy_version": rt.version - 2})
        fresh = Trajectory(id="t-fresh", task_id="g-fresh", turns=[fresh_turn], reward=1.0)
        stale_turn = real_turn(live_server, sdk).model_copy(update={"policy_version": rt.version - 3})
        stale = Trajectory(id="t-stale", task_id="g-stale", turns=[stale_turn], reward=1.0)
        bad_turn = real_turn(live_server, sdk)
        bad_turn = bad_turn.model_copy(
            update={"completion_token_ids": [10**6] * len(bad_turn.completion_token_ids), "policy_version": rt.version}
        )
        bad_tokens = Trajectory(id="t-bad", task_id="g-bad", turns=[bad_turn], reward=0.0)
        body = {"trajectories": [t.model_dump(mode="json") for t in (fresh, stale, bad_tokens)]}
        res = post(live_server, "/v1/trajectories", json=body).json()["results"]
        assert [r["status"] for r in res] == ["accepted", "rejected", "rejected"]
        assert "stale" in res[1]["reason"] and "max_staleness is 2" in res[1]["reason"]
        assert "vocabulary" in res[2]["reason"]
        again = post(live_server, "/v1/trajectories", json={"trajectories": [fresh.model_dump(mode="json")]}).json()[
            "results"
        ]
        assert again[0]["status"] == "duplicate"
        counts = httpx2.get(live_server.url + "/v1/status").json()["trajectories"]
        assert counts["rejected_by_reason"]["stale"] >= 1 and counts["duplicate"] >= 1
    finally:
        rt.loop.live = (version, step)


def test_duplicate_inside_one_batch_is_trained_once(live_server, sdk):
    t = Trajectory(id="t-twice", task_id="g-twice", turns=[real_turn(live_server, sdk)], reward=1.0)
    body = {"trajectories": [t.model_dump(mode="json")]}
    before = live_server.runtime.buffer.buffered
    res = post(live_server, "/v1/trajectories", json={"trajectories": body["trajectories"] * 2}).json()["results"]
    assert [r["status"] for r in res] == ["accepted", "duplicate"]
    assert post(live_server, "/v1/trajectories", json=body).json()["results"][0]["status"] == "duplicate"
    assert live_server.runtime.buffer.buffered == before + 1  # buffered for training once


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (
            {"trajectories": [{"id": "x", "task_id": "t", "turns": [], "status": "failed", "extra_field": 1}]},
            "extra_field: unknown field",
        ),
        ({"trajectories": [{"id": "x", "task_id": "t", "reward": "high", "status": "failed"}]}, "reward"),
        ({"trajectories": [{"id": "x", "task_id": "t", "reward": 1.0}]}, "at least one turn"),
        ({"trajectories": []}, "trajectories"),
        ({"trajectory": []}, "trajectory: unknown field"),
    ],
)
def test_bad_trajectory_batches_get_400(live_server, body, needle):
    r = post(live_server, "/v1/trajectories", json=body)
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def real_turn(live_server, sdk, version_offset=0):
    reply = sdk.chat.completions.create(model="agentjet-tiny", messages=ASK, max_tokens=4)
    ext = reply.choices[0].model_extra["agentjet"]
    return Turn(
        policy_version=ext["policy_version"] - version_offset,
        prompt_token_ids=ext["prompt_token_ids"],
        completion_token_ids=ext["completion_token_ids"],
        completion_logprobs=ext["completion_logprobs"],
        finish_reason=ext["finish_reason"],
    )
