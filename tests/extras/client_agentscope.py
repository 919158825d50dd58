"""agentjet-client[agentscope] alone: AgentScope's own Agent and OpenAIChatModel through the capture proxy."""

import asyncio

from _smoke import server_url, try_example
from agentscope.agent import Agent, InjectionConfig
from agentscope.message import UserMsg

from agentjet_client import SwarmClient


async def play(client: SwarmClient) -> tuple[int, str]:
    try:
        episode = client.episode("smoke-agentscope")
        model = episode.agentscope(agent="scope", max_tokens=6, stream=False)
        quiet = InjectionConfig(inject_runtime_state=False)
        agent = Agent(name="helper", system_prompt="You answer briefly.", model=model, injection_config=quiet)
        reply = await agent.reply(UserMsg(name="user", content="Write seven as a digit."))
        await episode.aclose()
        turns = episode.to_trajectory(1.0).turns
        assert episode.recorder.failures == 0 and len(turns) == 1 and turns[0].agent == "scope", turns
        return len(turns[0].completion_token_ids), reply.get_text_content() or ""
    finally:
        await client.aclose_pool()


with SwarmClient(server_url()) as client:
    tokens, text = asyncio.run(play(client))
assert "── call 0" in try_example("agentscope_agent")
print(f"agentscope: captured {tokens} tokens ({text!r}); examples/agentscope_agent plays")
