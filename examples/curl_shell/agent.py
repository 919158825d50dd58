"""An agent written as a shell script (``curl`` + ``jq``), trained like any other.

    agentjet-client run --code-dir examples/curl_shell --server http://127.0.0.1:8000 --episodes 640

The Python side only starts ``bash agent.sh`` with the episode's capture-proxy URL and key in its
environment and reads the answers it prints. The script makes two calls of one conversation, the
second streamed (server-sent events read with ``sed``); the proxy captures both, token-exact, and
names the first call as the one the second continues.
"""

import json
import os
import subprocess
from pathlib import Path

from agentjet_client import swarm_agent

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
SCRIPT = Path(__file__).with_name("agent.sh")


@swarm_agent(tasks=[{"id": f"digit-{d}", "word": WORDS[d], "answer": str(d)} for d in (3, 8)])
def shell_agent(task, episode):
    env = {**os.environ, "AGENTJET_BASE_URL": episode.base_url, "AGENTJET_API_KEY": episode.api_key}
    done = subprocess.run(
        ["bash", str(SCRIPT), task["word"]], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    answers = json.loads(done.stdout.strip().splitlines()[-1])
    return (float(answers["first"].strip() == task["answer"]) + float(answers["second"].strip() == task["answer"])) / 2
