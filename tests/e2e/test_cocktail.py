"""A cocktail of two task families in one client run, real processes on 127.0.0.1.

One ``agentjet-server up --mix a=3,b=1``; one ``agentjet-client run --code-dir A --code-dir B``,
where family a needs numpy (which the test's environment has) and family b runs in a second
interpreter, named by its ``agentjet.toml``, that has agentjet-client and nothing else (b's agent
fails if numpy is importable, so every complete b episode ran there). The server's admission keeps
the trained episodes at 3:1 per tag and reports each tag's reward; an edit of b's code mid-run is
swapped in for b's episodes only.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agentjet_client.run.loader import code_version
from tests.conftest import ServerProcess, reap

pytestmark = pytest.mark.e2e
EPISODES = 480

FAMILY_A = """
import numpy as np  # this family's dependency: present in the run's own interpreter only

from agentjet_client import swarm_agent

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


@swarm_agent(tasks=[{"id": f"a-{d}", "word": WORDS[d], "answer": str(d)} for d in (3, 8)], tag="a")
def family_a(task, episode):
    reply = episode.openai().chat.completions.create(
        model="agentjet-tiny", messages=[{"role": "user", "content": f"Write {task['word']} as a digit."}], max_tokens=3
    )
    return np.float64((reply.choices[0].message.content or "").strip() == task["answer"])
"""

FAMILY_B = """
import importlib.util

from agentjet_client import swarm_agent

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
REVISION = {revision}


@swarm_agent(tasks=[{{"id": f"b-{{d}}", "word": WORDS[d], "answer": str(d)}} for d in (1, 6)], tag="b")
async def family_b(task, episode):
    if importlib.util.find_spec("numpy") is not None:
        raise RuntimeError("numpy is importable: this agent is not running in its own interpreter")
    reply = await episode.async_openai().chat.completions.create(
        model="gpt-4o-mini",
        messages=[{{"role": "user", "content": f"Write {{task['word']}} as a digit."}}],
        max_tokens=3,
    )
    return float((reply.choices[0].message.content or "").strip() == task["answer"])
"""


def test_two_families_one_in_its_own_interpreter_train_at_the_servers_mix(tmp_path, client_only_python):
    a, b = tmp_path / "family_a", tmp_path / "family_b"
    a.mkdir()
    b.mkdir()
    (a / "agent.py").write_text(FAMILY_A)
    (b / "agent.py").write_text(FAMILY_B.format(revision=1))
    (b / "agentjet.toml").write_text(f'python = "{client_only_python}"\n')
    first_b = code_version(b)
    args = ["--mix", "a=3,b=1", "--batch-groups", "2", "--group-size", "4", "--state-dir", str(tmp_path / "state")]
    server = ServerProcess(args, tmp_path / "server.log")
    command = [str(Path(sys.executable).parent / "agentjet-client"), "run", "--code-dir", str(a), "--code-dir", str(b)]
    command += ["--server", server.url, "--episodes", str(EPISODES), "--group-size", "4", "--concurrency", "8"]
    command += ["--seed", "0", "--spool-dir", str(tmp_path / "spool")]
    client = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=os.environ)
    try:
        deadline = time.monotonic() + 300
        while server.status()["by_tag"].get("b", {}).get("accepted", 0) < 24:
            assert client.poll() is None, client.communicate()[0]
            assert time.monotonic() < deadline, server.status()
            time.sleep(0.2)
        (b / "agent.py").write_text(FAMILY_B.format(revision=2))  # hot swap, in b's interpreter only
        second_b = code_version(b)
        out, _ = client.communicate(timeout=600)
        assert client.returncode == 0, out
        status = server.wait_trained()
    finally:
        reap(client)
        server.stop()
    assert f"family_b (code {first_b} tag b) in {client_only_python}" in out
    assert "failed 0" in out, out
    tags = status["by_tag"]
    trained = {tag: tags[tag]["trained"] for tag in ("a", "b")}
    ratio = trained["a"] / trained["b"]
    found = re.findall(r"tag (\w+): (\d+) episodes started, mean reward ([\d.]+)", out)
    client_means = {tag: float(mean) for tag, _, mean in found}
    print(
        f"cocktail --mix a=3,b=1: trained a {trained['a']}, b {trained['b']} (ratio {ratio:.3f}); "
        f"reward a {tags['a']['mean_reward']:.3f}, b {tags['b']['mean_reward']:.3f}; "
        f"staleness a {tags['a']['mean_lag']:.2f}, b {tags['b']['mean_lag']:.2f}"
    )
    assert sum(trained.values()) == EPISODES
    assert 2.7 <= ratio <= 3.3, trained
    for tag in ("a", "b"):  # each tag's reward, as the server computed it, is the client's
        assert tags[tag]["share"] == {"a": 0.75, "b": 0.25}[tag]
        assert tags[tag]["mean_reward"] == pytest.approx(client_means[tag], abs=1e-3)
        assert tags[tag]["mean_lag"] is not None
    versions = ast.literal_eval(out.split("episodes per code version: ", 1)[1].splitlines()[0])
    assert versions[first_b] > 0 and versions[second_b] > 0, versions  # b's edit taken mid-run
    assert versions[code_version(a)] == trained["a"]  # a kept its code
