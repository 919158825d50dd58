"""agentjet-client with no extra (at the newest versions its ranges allow, and at the lowest): a captured
OpenAI SDK call, token-exact and signed, and the digits example played by ``agentjet-client try``."""

import importlib.metadata

from _smoke import server_url, try_example

from agentjet_client import SwarmClient

with SwarmClient(server_url()) as client:
    episode = client.episode("smoke-core")
    reply = episode.openai().chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Write seven as a digit."}], max_tokens=4
    )
    episode.close()
    turns = episode.to_trajectory(1.0).turns
    assert episode.recorder.failures == 0 and len(turns) == 1 and turns[0].signature, turns
    assert turns[0].completion_token_ids and reply.choices[0].message.content is not None
assert "── call 0" in try_example("digits")
versions = ", ".join(f"{name} {importlib.metadata.version(name)}" for name in ("openai", "httpx2", "pydantic"))
print(f"core: a captured call and examples/digits ({versions})")
