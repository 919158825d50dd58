"""Capture of the other APIs: Responses (OpenAI SDK), Messages (Anthropic SDK) and text completions,
through the SDK transports and through the loopback proxy. Each call is one turn, and a conversation
continued in the API's own item or block shapes merges into one timeline, as a chat one does."""

from __future__ import annotations

import asyncio

import anthropic
import httpx2

from agentjet_client import SwarmClient
from agentjet_server.batching.timeline import build_timelines
from tests.conftest import MESSAGE_TOOLS, RESPONSE_TOOLS

ASK = [{"role": "user", "content": "What is 2 + 3?"}]


def merged(turns) -> dict[str, int]:  # type: ignore[no-untyped-def]
    """Timelines per agent."""
    out: dict[str, int] = {}
    for timeline in build_timelines(turns):
        out[timeline.agent] = out.get(timeline.agent, 0) + 1
    return out


def test_responses_and_messages_conversations_merge_into_one_timeline_each(live_server):
    with SwarmClient(live_server.url) as client:
        episode = client.episode("apis")
        oa = episode.openai(agent="codex")  # a Responses-API agent written for a hosted model
        first = oa.responses.create(
            model="gpt-4o-mini", input=ASK, tools=RESPONSE_TOOLS, max_output_tokens=30, temperature=0.0
        )
        history = [*ASK, *[item.model_dump(exclude_none=True) for item in first.output]]
        calls = [item for item in first.output if item.type == "function_call"]
        assert calls, first.output  # the warmed model calls a tool greedily
        history.append({"type": "function_call_output", "call_id": calls[0].call_id, "output": "5"})
        with oa.responses.stream(model="gpt-4o-mini", input=history, tools=RESPONSE_TOOLS, max_output_tokens=6) as s:
            s.get_final_response()
        claude = episode.anthropic(agent="claude")
        greedy = {"extra_body": {"temperature": 0.0}}
        reply = claude.messages.create(
            model="claude-for-this-agent", max_tokens=30, messages=ASK, tools=MESSAGE_TOOLS, **greedy
        )
        uses = [b for b in reply.content if b.type == "tool_use"]
        assert uses, reply.content
        conversation = [
            *ASK,
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "5"}]},
        ]
        with claude.messages.stream(
            model="claude-for-this-agent", max_tokens=6, messages=conversation, tools=MESSAGE_TOOLS
        ) as s:
            s.get_final_message()
        episode.openai(agent="legacy").completions.create(
            model="gpt-3.5-turbo-instruct", prompt="Once upon", max_tokens=4
        )
        trajectory = episode.to_trajectory(1.0)
        failures = episode.recorder.failures
        episode.close()
    assert failures == 0
    turns = trajectory.turns
    assert [(t.agent, t.requested_model) for t in turns] == [
        ("codex", "gpt-4o-mini"),
        ("codex", "gpt-4o-mini"),
        ("claude", "claude-for-this-agent"),
        ("claude", "claude-for-this-agent"),
        ("legacy", "gpt-3.5-turbo-instruct"),
    ]
    # each turn keeps the token limit it was sampled under, whatever the API called it (overlong shaping reads it)
    assert [t.max_tokens for t in turns] == [30, 6, 30, 6, 4]
    # each turn records the chat messages its request meant: the tool result is a tool message
    assert turns[1].request_messages[-1] == {"role": "tool", "tool_call_id": calls[0].call_id, "content": "5"}
    assert turns[3].request_messages[-1] == {"role": "tool", "tool_call_id": uses[0].id, "content": "5"}
    assert merged(turns) == {"codex": 1, "claude": 1, "legacy": 1}  # each conversation is one timeline
    for a, b in ((turns[0], turns[1]), (turns[2], turns[3])):  # continued from the exact sampled tokens
        assert b.prompt_token_ids[: len(a.prompt_token_ids) + len(a.completion_token_ids)] == [
            *a.prompt_token_ids,
            *a.completion_token_ids,
        ]


def test_async_clients_and_the_proxy_capture_every_api(live_server):
    async def run(client, episode):  # type: ignore[no-untyped-def]
        await episode.async_openai(agent="e").responses.create(
            model="m", input="Write one as a digit.", max_output_tokens=3
        )
        async with episode.async_anthropic(agent="f").messages.stream(model="m", max_tokens=3, messages=ASK) as s:
            await s.get_final_message()
        trajectory = episode.to_trajectory(1.0)
        await episode.aclose()
        await client.aclose_pool()  # the shared async pool belongs to this event loop
        return trajectory

    with SwarmClient(live_server.url) as client:
        episode = client.episode("proxy")
        # any program: the proxy's base URLs (an Anthropic SDK takes the base without /v1)
        httpx2.post(episode.url_for("a") + "/responses", json={"model": "m", "input": "Hi", "max_output_tokens": 3})
        body = {"model": "m", "input": "Hi", "max_output_tokens": 3, "stream": True}
        with httpx2.stream("POST", episode.url_for("b") + "/responses", json=body) as r:
            r.read()
        with anthropic.Anthropic(base_url=episode.url_for("c").removesuffix("/v1"), api_key=episode.api_key) as sdk:
            sdk.messages.create(model="m", max_tokens=3, messages=ASK)
        httpx2.post(episode.url_for("d") + "/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 2})
        trajectory = asyncio.run(run(client, episode))
        failures = episode.recorder.failures
    assert failures == 0
    assert [t.agent for t in trajectory.turns] == ["a", "b", "c", "d", "e", "f"]
    assert all(t.signature for t in trajectory.turns)
