"""agentjet-client[anthropic] alone: the Anthropic SDK's Messages API through the capture proxy."""

from _smoke import server_url, try_example

from agentjet_client import SwarmClient

with SwarmClient(server_url()) as client:
    episode = client.episode("smoke-anthropic")
    reply = episode.anthropic(agent="claude").messages.create(
        model="claude-for-this-agent", max_tokens=8, messages=[{"role": "user", "content": "Write seven as a digit."}]
    )
    episode.close()
    turns = episode.to_trajectory(1.0).turns
    assert episode.recorder.failures == 0 and len(turns) == 1 and turns[0].agent == "claude", turns
    assert reply.content and reply.content[0].type == "text", reply
assert "── call 0" in try_example("anthropic_agent")
print(f"anthropic: captured {len(turns[0].completion_token_ids)} tokens; examples/anthropic_agent plays")
