"""Framework adapters against a real server: LangChain's own ChatOpenAI through the capture proxy."""

from __future__ import annotations

import asyncio

import pytest

from agentjet_client import SwarmClient

pytest.importorskip("langchain_openai")
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def test_langchain_invoke_stream_and_async_are_captured_token_exact(live_server):
    with SwarmClient(live_server.url) as client:
        episode = client.episode("lc")
        llm = episode.langchain(agent="writer", max_tokens=6, temperature=1.0, seed=5)
        said = llm.invoke("Write seven as a digit.").content
        streamed = "".join(str(c.content) for c in llm.stream("Write seven as a digit."))

        async def in_a_loop() -> object:
            try:
                return (await llm.ainvoke("Write seven as a digit.")).content
            finally:
                await client.aclose_pool()  # the shared async pool belongs to this event loop

        again = asyncio.run(in_a_loop())
        episode.close()
        turns = episode.to_trajectory(1.0).turns
        assert episode.recorder.failures == 0
    assert len(turns) == 3 and {t.agent for t in turns} == {"writer"} and {t.max_tokens for t in turns} == {6}
    # same seed: streaming and not give the same tokens, and the text the agent saw is theirs
    assert turns[0].completion_token_ids == turns[1].completion_token_ids == turns[2].completion_token_ids
    whole = [t.model_dump(exclude={"started_at", "latency_s", "signature"}) for t in turns]
    assert whole[0] == whole[1] == whole[2]  # the same trajectory, field for field
    signer = live_server.runtime.signer  # each sampling signed once (the nonce differs), each verifies
    assert len({t.signature for t in turns}) == 3 and all(signer.verify_turn(t) for t in turns)
    assert said == streamed == again


def test_langchain_tool_calls_round_trip(live_server):
    """A forced call is a tool call whenever the tiny model's JSON parses; draw until one does, then
    send the result back the LangChain way and check the next prompt continues the sampled tokens."""
    with SwarmClient(live_server.url) as client:
        episode = client.episode("lc-tools")
        messages = [HumanMessage("What is 2 + 3?")]
        for seed in range(24):
            llm = episode.langchain(max_tokens=40, seed=seed).bind_tools([add], tool_choice="add")
            reply = llm.invoke(messages)
            if reply.tool_calls:
                break
        assert reply.tool_calls and reply.tool_calls[0]["name"] == "add", "no parsable call in 24 samples"
        messages += [reply, ToolMessage("5", tool_call_id=reply.tool_calls[0]["id"])]
        episode.langchain(max_tokens=8).bind_tools([add]).invoke(messages)
        episode.close()
        turns = episode.to_trajectory(1.0).turns
    called, follow_up = turns[-2], turns[-1]
    assert follow_up.request_messages[1]["tool_calls"][0]["function"]["name"] == "add"
    assert follow_up.request_messages[2]["role"] == "tool"
    prefix = called.prompt_token_ids + called.completion_token_ids
    assert follow_up.prompt_token_ids[: len(prefix)] == prefix  # continued from the sampled tokens
