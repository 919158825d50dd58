"""agentjet-client[langchain] alone: LangChain's ChatOpenAI through the capture proxy, and the example agent."""

from _smoke import server_url, try_example

from agentjet_client import SwarmClient

with SwarmClient(server_url()) as client:
    episode = client.episode("smoke-langchain")
    said = episode.langchain(agent="writer", max_tokens=6, seed=1).invoke("Write seven as a digit.").content
    episode.close()
    turns = episode.to_trajectory(1.0).turns
    assert episode.recorder.failures == 0 and len(turns) == 1 and turns[0].completion_token_ids, turns
assert "── call 0" in try_example("langchain_agent")
print(f"langchain: captured {len(turns[0].completion_token_ids)} tokens ({said!r}); examples/langchain_agent plays")
