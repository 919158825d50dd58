"""Traces across the swarm (``agentjet_client.tracing``, ``agentjet_server.observe.tracing``), recorded with an
in-memory exporter: a two-turn episode is one trace across the client's spans (the episode, each model call, through
the capture transport and through the capture proxy) and the server's (each API request, the ingest of its
trajectory), and the learner-step span links the trajectories it trained."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx2
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from agentjet_client import SwarmClient, tracing
from tests.conftest import LiveServer


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use_provider(provider)
    yield exporter
    tracing.use_provider(None)
    provider.shutdown()


@pytest.fixture(scope="module")
def server(model_dir) -> Iterator[LiveServer]:  # type: ignore[no-untyped-def]
    live = LiveServer(model_dir, group_size=2, batch_groups=1, max_staleness=8)
    yield live
    live.stop()


def two_turns(episode, via_proxy: bool) -> None:  # type: ignore[no-untyped-def]
    """Two model calls: through the episode's own client (the capture transport), or as any HTTP client does,
    through the capture proxy at the episode's base_url."""
    messages = [{"role": "user", "content": "Write seven as a digit."}]
    for _ in range(2):
        if via_proxy:
            answer = httpx2.post(
                episode.base_url + "/chat/completions",
                json={"model": "agentjet-tiny", "messages": messages, "max_tokens": 3},
                timeout=60,
            ).json()
        else:
            answer = episode.openai().chat.completions.create(model="agentjet-tiny", messages=messages, max_tokens=3)
            answer = answer.model_dump()
        messages += [answer["choices"][0]["message"], {"role": "user", "content": "Again."}]


def wait_for_span(exporter: InMemorySpanExporter, name: str, limit: float = 60):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + limit
    while True:
        found = [s for s in exporter.get_finished_spans() if s.name == name]
        if found:
            return found
        assert time.monotonic() < deadline, f"no {name} span"
        time.sleep(0.05)


def test_a_two_turn_episode_is_one_trace_and_the_learner_step_links_it(server, spans):
    with SwarmClient(server.url) as client:
        trajectories = []
        for i, via_proxy in enumerate((False, True)):  # one group of two: a batch, so a learner step
            episode = client.episode("task-traced")
            two_turns(episode, via_proxy)
            episode.close()
            trajectories.append(episode.to_trajectory(float(i)))
        assert all(t.traceparent for t in trajectories)
        result = client.submit(trajectories)
        assert [r.status for r in result.results] == ["accepted", "accepted"]
    steps = wait_for_span(spans, "learner step")
    finished = spans.get_finished_spans()
    for trajectory in trajectories:
        trace_id = int(trajectory.traceparent.split("-")[1], 16)  # type: ignore[union-attr]
        mine = [s for s in finished if s.context.trace_id == trace_id]
        names = sorted(s.name for s in mine)
        assert names == sorted(
            ["episode", "chat", "chat", "POST /v1/chat/completions", "POST /v1/chat/completions", "ingest"]
        ), names
        episode_span = next(s for s in mine if s.name == "episode")
        calls = [s for s in mine if s.name == "chat"]
        assert all(s.parent.span_id == episode_span.context.span_id for s in calls)  # type: ignore[union-attr]
        served = [s for s in mine if s.name.startswith("POST")]
        assert {s.parent.span_id for s in served} == {s.context.span_id for s in calls}  # type: ignore[union-attr]
        assert all(s.attributes["http.response.status_code"] == 200 for s in served)  # type: ignore[index]
        ingest = next(s for s in mine if s.name == "ingest")
        assert ingest.parent.span_id == episode_span.context.span_id  # type: ignore[union-attr]
        assert ingest.attributes["agentjet.trajectory_id"] == trajectory.id  # type: ignore[index]
    linked = {link.attributes["agentjet.trajectory_id"]: link.context.trace_id for link in steps[0].links}  # type: ignore[index]
    assert linked == {t.id: int(t.traceparent.split("-")[1], 16) for t in trajectories}  # type: ignore[union-attr]


def test_without_a_provider_nothing_is_recorded_and_no_header_is_sent(server):
    with SwarmClient(server.url) as client:
        episode = client.episode("task-untraced")
        two_turns(episode, via_proxy=False)
        episode.close()
        assert episode.to_trajectory(1.0).traceparent is None
        assert episode.trace_ids == (None, None)
