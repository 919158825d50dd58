"""An agent written in JavaScript (Node.js ``fetch``), trained like any other.

    agentjet-client run --code-dir examples/node_fetch --server http://127.0.0.1:8000 --episodes 640

The Python side only starts ``node agent.mjs`` with the episode's capture-proxy URL and key in its
environment and reads the answers it prints; the JavaScript knows nothing about AgentJet. Every
call it makes through that URL is captured into the episode (two turns of one conversation).
"""

import json
import os
import subprocess
from pathlib import Path

from agentjet_client import swarm_agent

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
SCRIPT = Path(__file__).with_name("agent.mjs")


@swarm_agent(tasks=[{"id": f"digit-{d}", "word": WORDS[d], "answer": str(d)} for d in (3, 8)])
def node_agent(task, episode):
    env = {**os.environ, "AGENTJET_BASE_URL": episode.base_url, "AGENTJET_API_KEY": episode.api_key}
    done = subprocess.run(
        ["node", str(SCRIPT), task["word"]], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    answers = json.loads(done.stdout.strip().splitlines()[-1])
    return (float(answers["first"] == task["answer"]) + float(answers["second"] == task["answer"])) / 2
