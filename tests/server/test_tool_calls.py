"""Tool-call health (``observe/tool_calls``): answers to requests with tools that open a call the server
cannot read, counted per agent and version, reported in the status and ``/metrics``, and a warning when
an agent's share rises well above where it started."""

from __future__ import annotations

import httpx2

from agentjet_server.observe.tool_calls import MIN_ANSWERS, ToolCallHealth
from tests.conftest import LiveServer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def test_malformed_calls_are_counted_per_agent_in_the_status_and_metrics(model_dir):
    server = LiveServer(model_dir)
    try:
        body = {
            "model": "agentjet-tiny",
            "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "tools": TOOLS,
            "max_tokens": 3,  # a call the model opens cannot close in three tokens: malformed
            "n": 32,
            "seed": 7,
            "agentjet": {"agent": "planner"},
        }
        answer = httpx2.post(server.url + "/v1/chat/completions", json=body, timeout=120).json()
        opened = sum("<tool_call>" in (c["message"]["content"] or "") for c in answer["choices"])
        assert opened >= 1  # the tiny model opens a call to a request with tools about every other time
        plain = {k: v for k, v in body.items() if k not in ("tools", "agentjet")}
        httpx2.post(server.url + "/v1/chat/completions", json=plain, timeout=120)  # no tools: not counted
        status = httpx2.get(server.url + "/v1/status").json()
        assert status["tool_calls"] == {
            "planner": {"answers": 32, "malformed": opened, "by_version": {"0": [32, opened]}}
        }
        metrics = httpx2.get(server.url + "/metrics").text
        assert 'agentjet_tool_call_answers_total{agent="planner"} 32.0' in metrics
        assert f'agentjet_tool_calls_malformed_total{{agent="planner"}} {float(opened)}' in metrics
    finally:
        server.stop()


def test_a_rising_share_of_malformed_calls_is_warned_about_once_per_version():
    warnings: list[str] = []
    health = ToolCallHealth(on_warning=warnings.append)

    def answers(version: int, malformed: int, agent: str = "executor") -> None:
        for i in range(MIN_ANSWERS):
            health.record(agent, version, i < malformed)

    answers(0, 2)  # the baseline: 2 of 32
    answers(1, 4)  # 12%: not 10 points above 6%
    assert warnings == []
    answers(2, 12)  # 38%: well above, and more than twice
    assert (
        len(warnings) == 1 and "agent executor" in warnings[0] and "v2" in warnings[0] and "(6% at v0)" in warnings[0]
    )
    health.record("executor", 2, True)  # the same version again: no second warning
    answers(3, 10)  # lower than the share already warned about
    assert len(warnings) == 1
    answers(4, 20)
    assert len(warnings) == 2 and "v4" in warnings[1]
    answers(0, 30, agent="other")  # another agent: its own baseline, however high
    assert len(warnings) == 2
    status = health.status()
    assert status["executor"].answers == 5 * MIN_ANSWERS + 1 and status["executor"].by_version["2"] == [33, 13]
    assert status["other"].malformed == 30
