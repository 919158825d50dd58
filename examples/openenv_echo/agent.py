"""An OpenEnv environment, served over HTTP by OpenEnv's own server, played by the model
(``agentjet_client.envs.openenv``): each episode opens a session, resets it, and sends the model's
replies as actions; the environment's rewards are the episode's.

    python examples/openenv_echo/echo_env.py --port 8200 &      # the environment (needs openenv-core)
    agentjet-client run --code-dir examples/openenv_echo --episodes 2000
"""

import os

from agentjet_client.envs.openenv import openenv_agent

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
CHOSEN = [int(d) for d in os.environ.get("AGENTJET_DIGITS", ",".join(map(str, range(10)))).split(",")]
TASKS = [{"id": f"echo-{WORDS[d]}", "reset": {"word": WORDS[d]}} for d in CHOSEN]

agent = openenv_agent(
    os.environ.get("AGENTJET_OPENENV_URL", "http://127.0.0.1:8200"),
    tasks=TASKS,
    eval_tasks=TASKS,
    name="echo",
    max_turns=2,
    max_tokens=4,
)
