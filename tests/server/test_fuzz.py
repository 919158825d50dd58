"""Hostile input against a real server on loopback: every named case of the review gets a 4xx that
names the field; generated bodies (hypothesis) never get a 5xx or a dropped connection.

``bench/fuzz.py`` runs the same strategies for thousands of cases and prints the counts.
"""

from __future__ import annotations

import asyncio

import httpx2
import pytest
from hypothesis import HealthCheck, given, settings

from tests.conftest import LiveServer
from tests.fuzz_requests import (
    CHAT,
    CHAT_BODIES,
    NAMED_CASES,
    TRAJECTORIES,
    TRAJECTORY_BODIES,
    Case,
    alongside_ordinary,
    check_answer,
)

EXAMPLES = 150  # per endpoint in the test suite; bench/fuzz.py runs thousands


@pytest.fixture(scope="module")
def server(model_dir):
    # small sampling budgets keep the valid generated requests fast
    live = LiveServer(model_dir, default_max_tokens=8, max_request_token_entries=4096, max_staleness=10**6)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server):
    with httpx2.Client(base_url=server.url, timeout=120) as http:
        yield http


@pytest.mark.parametrize("case", NAMED_CASES, ids=[c.name for c in NAMED_CASES])
def test_each_hostile_body_gets_a_4xx_naming_what_is_wrong(client, case: Case):
    response = client.post(case.path, content=case.body, headers={"content-type": "application/json"})
    assert 400 <= response.status_code < 500, f"{response.status_code}: {response.text[:500]}"
    error = response.json()["error"]
    assert {"message", "type", "param", "code"} <= set(error)
    said = f"{error['message']} {error['param']}"
    assert case.names in said, said
    assert len(error["message"]) < 2000  # the first few problems, never all of them


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=CHAT_BODIES)
def test_generated_chat_requests_never_get_a_5xx(client, body):
    check_answer(client, CHAT, body)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=TRAJECTORY_BODIES)
def test_generated_trajectory_batches_never_get_a_5xx(client, body):
    check_answer(client, TRAJECTORIES, body)


def test_hostile_sampling_settings_fail_their_own_request_only(server):
    """Denormal temperatures and nuclei, huge logit biases, penalties at their bounds, sent together with 32
    ordinary requests into one batch: each ordinary one is answered, each hostile one too or refused by name."""
    for _ in range(2):
        assert asyncio.run(alongside_ordinary(server.url, "agentjet-tiny")) == []


def test_the_server_still_serves_after_the_fuzzing(client):
    reply = client.post(CHAT, json={"messages": [{"role": "user", "content": "Say one."}], "max_tokens": 2})
    assert reply.status_code == 200 and reply.json()["choices"][0]["agentjet"]["completion_token_ids"]
