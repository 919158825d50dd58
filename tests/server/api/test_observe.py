"""What people and scrapers watch (``api.observe``): the dashboard page, served without a key (it asks for one),
``/metrics`` in Prometheus's text format with the figures ``/v1/status`` reports, the metrics history after
a sequence number, by kind and limited, and the dashboard's overview; on a real server on loopback that
requires a key for everything else."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx2
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agentjet_client.protocol import ClientReport, Trajectory
from agentjet_server.api.observe import DASHBOARD
from agentjet_server.observe.exposition import CONTENT_TYPE
from tests.conftest import LiveServer
from tests.server.ingest.trajectories import traj

KEY = "client-key-observe"


@pytest.fixture(scope="module")
def keyed(model_dir) -> Iterator[LiveServer]:
    # hand-made trajectories carry no signature: a keyed server takes them only if told to
    server = LiveServer(model_dir, api_keys=[KEY], require_signed=False, batch_groups=1, group_size=2)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def http(keyed: LiveServer) -> Iterator[httpx2.Client]:
    with httpx2.Client(base_url=keyed.url, headers={"authorization": f"Bearer {KEY}"}, timeout=60) as client:
        yield client


def scrape(http: httpx2.Client) -> dict[str, float]:
    """``/metrics`` read by prometheus-client's own parser: ``name{label=value,...}`` -> value."""
    response = http.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"] == CONTENT_TYPE
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def push(http: httpx2.Client, *trajectories: Trajectory, client: ClientReport | None = None) -> list[str]:
    body: dict[str, Any] = {"trajectories": [t.model_dump(mode="json") for t in trajectories]}
    if client is not None:
        body["client"] = client.model_dump()
    return [r["status"] for r in http.post("/v1/trajectories", json=body).json()["results"]]


def test_the_home_page_is_the_dashboard_which_needs_no_key(keyed):
    home = httpx2.get(keyed.url + "/", follow_redirects=False)
    assert home.status_code == 307 and home.headers["location"] == "/dashboard"
    page = httpx2.get(keyed.url + "/dashboard")
    assert page.status_code == 200 and page.content == DASHBOARD.read_bytes()  # one self-contained file
    assert page.headers["content-type"] == "text/html; charset=utf-8" and page.headers["cache-control"] == "no-cache"
    for path in ("/metrics", "/v1/metrics/history", "/v1/overview"):  # what the page reads needs the key
        assert httpx2.get(keyed.url + path).status_code == 401, path


def test_metrics_report_the_figures_of_the_status(keyed, http):
    before = scrape(http)
    reply = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    sampled = len(reply.json()["choices"][0]["agentjet"]["completion_token_ids"])
    assert push(http, traj(900, task_id="alone"), traj(901, token=5000)) == ["accepted", "rejected"]
    after = scrape(http)
    counts = http.get("/v1/status").json()["trajectories"]
    assert after["agentjet_engine_requests_total"] - before["agentjet_engine_requests_total"] == 1
    assert after["agentjet_tokens_sampled_total"] - before["agentjet_tokens_sampled_total"] == sampled
    accepted = after["agentjet_trajectories_total{outcome=accepted}"]
    assert accepted - before.get("agentjet_trajectories_total{outcome=accepted}", 0) == 1
    assert accepted == counts["accepted"]
    assert (
        after["agentjet_trajectories_rejected_total{reason=invalid_tokens}"]
        == counts["rejected_by_reason"]["invalid_tokens"]
    )
    assert after["agentjet_buffer_trajectories"] == counts["buffered"] >= 1  # a group of one, waiting
    assert after["agentjet_policy_version"] == http.get("/v1/status").json()["policy_version"]


def test_metrics_off_is_a_400_that_says_so(model_dir):
    server = LiveServer(model_dir, metrics=False)
    try:
        r = httpx2.get(server.url + "/metrics")
        assert r.status_code == 400 and r.json()["error"]["code"] == "metrics_off"
        assert "started with --no-metrics" in r.json()["error"]["message"]
    finally:
        server.stop()


def test_the_history_is_read_after_a_sequence_number_by_kind_and_limited(http):
    start = http.get("/v1/metrics/history?limit=1").json()["last_seq"]
    evaluations = [traj(910 + i, purpose="eval", reward=float(i)) for i in range(3)]
    assert push(http, *evaluations) == ["accepted"] * 3
    answer = http.get(f"/v1/metrics/history?since={start}&kind=eval").json()
    lines = answer["lines"]
    assert [x["id"] for x in lines] == ["t910", "t911", "t912"] and [x["reward"] for x in lines] == [0.0, 1.0, 2.0]
    assert [x["seq"] for x in lines] == [start + 1, start + 2, start + 3] and answer["last_seq"] >= start + 3
    assert {x["kind"] for x in lines} == {"eval"} and all(x["policy_version"] == 0 for x in lines)
    after_first = http.get(f"/v1/metrics/history?since={start + 1}&kind=eval").json()["lines"]
    assert [x["id"] for x in after_first] == ["t911", "t912"]
    newest = http.get(f"/v1/metrics/history?since={start}&kind=eval&limit=2").json()["lines"]
    assert [x["id"] for x in newest] == ["t911", "t912"]  # the newest, in order
    assert len(http.get(f"/v1/metrics/history?since={start}&limit=0").json()["lines"]) == 1  # at least one
    assert http.get(f"/v1/metrics/history?since={start}&kind=step,config").json()["lines"] == []


def test_the_overview_shows_status_rewards_clients_and_recent_events(http):
    report = ClientReport(id="laptop-9", spool_depth=3, episodes=5, running=1)
    statuses = push(http, traj(920, task_tag="math"), traj(921, token=5000, task_id="bad"), client=report)
    assert statuses == ["accepted", "rejected"]
    overview = http.get("/v1/overview").json()
    status = http.get("/v1/status").json()
    assert overview["status"]["trajectories"] == status["trajectories"]
    assert overview["status"]["model"] == "agentjet-tiny"
    assert overview["figures"]["accepted"] == status["trajectories"]["accepted"]
    math = [r for r in overview["rewards"]["by_tag"] if r["tag"] == "math"]
    assert math == [{"purpose": "train", "tag": "math", "episodes": 1, "mean": 0.0}]
    assert [c["id"] for c in overview["clients"] if c["spool_depth"] == 3] == ["laptop-9"]
    rejected = [e for e in overview["recent"] if e["kind"] == "rejected" and e["id"] == "t921"]
    assert len(rejected) == 1 and "vocabulary" in rejected[0]["message"]
    assert overview["last_step"] is None  # no step yet: its groups are incomplete
    config = overview["config"]  # the effective configuration, keys redacted
    assert config["config"]["group_size"] == 2 and config["config"]["batch_groups"] == 1
    assert KEY not in str(config) and "group_size" in config["live"] and not config["paused"]
