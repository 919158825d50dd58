"""agentjet-client[verifiers] alone: the example's verifiers environment (load_environment, its dataset, its
rubric) plays one captured episode against a server."""

import asyncio
import importlib.util

from _smoke import ROOT, server_url

from agentjet_client import SwarmClient
from agentjet_client.tasks.rewards import Scored

spec = importlib.util.spec_from_file_location("verifiers_example", ROOT / "examples" / "verifiers_env" / "agent.py")
assert spec is not None and spec.loader is not None
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)
agent = example.agent
task = next(iter(agent.tasks))  # type: ignore[call-overload]


async def play(client: SwarmClient) -> Scored:
    try:
        episode = client.episode("smoke-verifiers")
        scored: Scored = await agent.fn(task, episode)
        await episode.aclose()
        turns = episode.to_trajectory(scored.reward).turns
        assert episode.recorder.failures == 0 and turns and turns[0].completion_token_ids, turns
        return scored
    finally:
        await client.aclose_pool()


with SwarmClient(server_url()) as client:
    scored = asyncio.run(play(client))
assert isinstance(scored, Scored) and "right_share" in scored.components, scored
print(f"verifiers: the countdown environment played task {task['id']!r}: reward {scored.reward:.2f}")
