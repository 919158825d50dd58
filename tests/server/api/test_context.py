"""What every route shares (``api.context``): the ``Api`` on ``app.state`` (the runtime, the settings the app
was made with, the body gate, the ``/metrics`` exposition over the runtime's telemetry), integer query
parameters and the admin API's small JSON bodies, each refused with a 400 that says what is wrong; on a real
server on loopback."""

from __future__ import annotations

import asyncio

import httpx2
import pytest

from agentjet_server.api import Api
from agentjet_server.ingest.bodies import LARGE_IN_FLIGHT
from agentjet_server.ingest.body_gate import BodyGate


def get(live_server, path: str) -> httpx2.Response:  # type: ignore[no-untyped-def]
    return httpx2.get(live_server.url + path, timeout=30)


def patch(live_server, body: bytes) -> httpx2.Response:  # type: ignore[no-untyped-def]
    headers = {"content-type": "application/json"}
    return httpx2.patch(live_server.url + "/v1/admin/config", content=body, headers=headers, timeout=30)


def test_the_api_on_app_state_holds_the_runtime_the_settings_and_the_body_gate(live_server):
    api = live_server.app.state.api
    assert isinstance(api, Api)
    assert api.runtime is live_server.runtime is live_server.app.state.runtime
    assert api.settings is live_server.settings  # as the app was created: keys, body limits, timeouts
    assert isinstance(api.gate, BodyGate) and isinstance(api.large, asyncio.Semaphore)
    assert api.large._value == LARGE_IN_FLIGHT  # large bodies held at once
    status = get(live_server, "/v1/status").json()
    rendered = api.exposition.render().decode()  # over the runtime's telemetry: what /metrics serves
    assert f"agentjet_policy_version {float(status['policy_version'])}" in rendered
    assert f"agentjet_learner_steps_total {float(status['learner']['step'])}" in rendered


def test_without_a_way_to_stop_the_process_a_stop_is_refused(live_server):
    assert live_server.app.state.api.on_stop is None  # made by create_app, not by `agentjet-server up`
    r = httpx2.post(live_server.url + "/v1/admin/stop", timeout=30)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == (
        "this server was not started by `agentjet-server up`; stop its process instead"
    )
    assert get(live_server, "/healthz").status_code == 200


@pytest.mark.parametrize(
    ("path", "name", "shown"),
    [
        ("/v1/metrics/history?since=abc", "since", "'abc'"),
        ("/v1/metrics/history?limit=1.5", "limit", "'1.5'"),
        ("/v1/trajectories?limit=" + "x" * 100, "limit", repr("x" * 40)),  # cut short
    ],
)
def test_an_integer_query_parameter_that_is_not_one_is_a_400_naming_it(live_server, path, name, shown):
    r = get(live_server, path)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["message"] == f"query parameter '{name}' must be an integer (got {shown})" and error["param"] == name


def test_integer_query_parameters_are_read_as_sent(live_server):
    assert get(live_server, "/v1/metrics/history?since=-5&limit=-3").status_code == 200  # bounded by the route
    assert get(live_server, "/v1/trajectories?limit=" + "9" * 30).status_code == 200


def test_the_config_body_must_be_a_json_object(live_server):
    for body, says in [
        (b"[1, 2]", 'the body must be a JSON object, e.g. {"lr": 0.0005}'),
        (b"{not json", "the body is not valid JSON: Expecting property name"),
        (b"", "send a JSON object of the settings to change"),  # read as {}: no settings named
        (b" \r\n\t", "send a JSON object of the settings to change"),  # only whitespace: as empty
        (b'{"lr": "' + b"1" * 70_000 + b'"}', "the body is 70010 bytes; at most 65536 are accepted here"),
    ]:
        r = patch(live_server, body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"].startswith(says)
