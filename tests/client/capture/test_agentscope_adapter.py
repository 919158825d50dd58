"""AgentScope 2.x's own OpenAIChatModel and Agent through the capture proxy, against a real server."""

from __future__ import annotations

import asyncio

import pytest

from agentjet_client import SwarmClient

pytest.importorskip("agentscope")
from agentscope.agent import Agent, InjectionConfig
from agentscope.message import UserMsg


def test_agentscope_streaming_and_not_give_the_same_trajectory(live_server):
    async def run(client: SwarmClient, stream: bool):  # type: ignore[no-untyped-def]
        episode = client.episode("scope")
        model = episode.agentscope(agent="scope", max_tokens=6, stream=stream, extra_body={"seed": 9})
        # no runtime-state injection: it writes the current time into the prompt
        quiet = InjectionConfig(inject_runtime_state=False)
        agent = Agent(name="helper", system_prompt="You answer briefly.", model=model, injection_config=quiet)
        reply = await agent.reply(UserMsg(name="user", content="Write seven as a digit."))
        await episode.aclose()
        return episode, reply.get_text_content()

    with SwarmClient(live_server.url) as client:

        async def both():  # type: ignore[no-untyped-def]
            try:
                return await run(client, True), await run(client, False)
            finally:
                await client.aclose_pool()

        (streamed, streamed_text), (plain, plain_text) = asyncio.run(both())
    a, b = streamed.to_trajectory(1.0).turns, plain.to_trajectory(1.0).turns
    assert streamed.recorder.failures == plain.recorder.failures == 0
    assert len(a) == len(b) == 1 and a[0].agent == "scope"
    assert a[0].prompt_token_ids == b[0].prompt_token_ids and a[0].completion_token_ids == b[0].completion_token_ids
    per_sampling = {"started_at", "latency_s", "signature"}  # the signature's nonce differs per sampling
    assert a[0].model_dump(exclude=per_sampling) == b[0].model_dump(exclude=per_sampling)  # field for field
    signer = live_server.runtime.signer
    assert signer.verify_turn(a[0]) and signer.verify_turn(b[0])
    assert streamed_text == plain_text
