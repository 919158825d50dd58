"""agentjet-client[gym] alone: the gymnasium text environment example plays an episode against a server."""

from _smoke import try_example

out = try_example("gym_text")
assert "── call 0" in out and "reward" in out, out
print("gym: examples/gym_text plays an episode")
