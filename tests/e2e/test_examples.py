"""Every example in examples/ runs against a real server, and none of them drifts: each call that
continues an earlier one does so token for token, so every episode trains as one timeline per agent."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from agentjet_client.protocol import Trajectory
from agentjet_server.ingest.wal import Accepted, read_records
from tests.conftest import ExampleService, RulesJudge, ServerProcess
from tests.e2e.drift import assert_no_drift

pytestmark = pytest.mark.e2e
EXAMPLES = sorted(p for p in (Path(__file__).resolve().parents[2] / "examples").iterdir() if (p / "agent.py").exists())


# these run on the embedded model that calls the tools a request lists (``--model-size tools``), as
# docs/guide.md tells users to; on the tiny model, which calls its own warm-up tools' names, the Agents
# SDK ends most runs at the first call (the agent has no such tool) and no tool result goes back
USES_TOOLS = {"tool_use", "langchain_agent", "agentscope_agent", "anthropic_agent", "openai_agents", "terminal_agent"}
# two GRPO groups of 8, a batch each: the untrained embedded model earns a reward rarely (digits about 1 in
# 10, AgentScope's adder about 1 in 16), so most groups' rewards are all equal, which alone gives no step;
# an entropy bonus gives such a group a gradient too, so every batch steps (twelve groups without it
# sometimes gave none), and the runs stay short: what is checked here is the calls, not the learning
EPISODES = 16


def answers_tool_calls(messages: list[dict[str, Any]]) -> bool:
    """The request sends tool results back, each answering a call of the assistant message before them."""
    for i, message in enumerate(messages):
        if message.get("role") != "tool":
            continue
        calls = next((m.get("tool_calls") for m in reversed(messages[:i]) if m.get("role") == "assistant"), None)
        assert calls and message.get("tool_call_id") in {c["id"] for c in calls}, messages
    return any(m.get("role") == "tool" for m in messages)


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs_and_does_not_drift(example, tmp_path, request):
    if example.name == "node_fetch" and shutil.which("node") is None:
        pytest.skip("the JavaScript example needs Node.js 18+ (node) on PATH")
    if example.name == "curl_shell" and not (shutil.which("curl") and shutil.which("jq")):
        pytest.skip("the shell example needs curl and jq on PATH")
    service, service_env = None, {}
    if example.name == "judged":  # a judge endpoint standing in for a judge model
        service = RulesJudge("digits")
        service_env = {"AGENTJET_JUDGE_URL": service.url}
    elif example.name == "openenv_echo":  # the example's environment, served by OpenEnv's own server
        service = ExampleService(example / "echo_env.py", probe="/health")
        service_env = {"AGENTJET_OPENENV_URL": service.base}
    request.addfinalizer(lambda: service.stop() if service is not None else None)
    state = tmp_path / "state"
    episodes = EPISODES
    tools = example.name in USES_TOOLS
    model_dir = request.getfixturevalue("tools_model_dir" if tools else "model_dir")
    args = ["--batch-groups", "1", "--group-size", "8", "--entropy-coef", "0.001", "--checkpoint-every", "0"]
    args += ["--state-dir", str(state)]
    server = ServerProcess([*args, "--model-size", "tools"] if tools else args, tmp_path / "s.log")
    try:
        exe = str(Path(sys.executable).parent / "agentjet-client")
        env = {**os.environ, "AGENTJET_DIGITS": "3,8", **service_env}
        # `try` first, as the docs say: one episode shown, its reward (or the judge's), nothing pushed; on the
        # untrained model (a trained one may answer nothing, which fails a verifiers episode, as it should)
        tried = subprocess.run(
            [exe, "try", "--code-dir", str(example), "--server", server.url], env=env, capture_output=True, text=True
        )
        assert tried.returncode == 0, tried.stdout[-2000:] + tried.stderr[-2000:]
        assert tried.stdout.startswith("── call 0  agent ") and "\nreward " in tried.stdout, tried.stdout[-2000:]
        tried_context = server.status()["context"]  # its calls count there; its episode is in no trajectory
        command = [exe, "run", "--code-dir", str(example), "--server", server.url, "--episodes", str(episodes)]
        command += ["--group-size", "8", "--seed", "0"]
        run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        status = server.wait_trained()  # the learner takes the last batches after the client is done
        records = list(read_records(state / "log"))  # before the shutdown checkpoint compacts the log
    finally:
        server.stop()
    counts = status["trajectories"]
    assert counts["accepted"] == episodes and counts["rejected"] == 0 and status["policy_version"] >= 1
    context = {key: value - tried_context.get(key, 0) for key, value in status["context"].items()}
    status = {**status, "context": context}
    trajectories = [Trajectory.model_validate(r.trajectory) for r in records if isinstance(r, Accepted)]
    assert len(trajectories) == episodes
    figures = assert_no_drift(trajectories, status, model_dir, tmp_path / "s.log")
    turns, continued = figures["turns"], figures["continued"]
    edited, retooled = figures["edited"], figures["retooled"]
    per_call, merged = figures["per_call"], figures["merged"]
    tool_turns = sum(answers_tool_calls(t.request_messages) for tr in trajectories for t in tr.turns)
    if tools:  # tool calls made it round: a call's result went back to the model
        assert tool_turns > 0
    print(
        f"{example.name}: {len(trajectories)} episodes accepted, policy v{status['policy_version']}, "
        f"{turns} turns verified as sampled, {tool_turns} sending tool results back, {continued} continued calls "
        f"({context['drift_prevented']} with drift prevented, {context['spliced']} spliced, {edited} answers "
        f"sent back edited by the framework, {retooled} with other tools listed), 0 drift; "
        f"tokens per call {per_call}, merged {merged}"
    )


def test_the_online_example_trains_through_the_gateway_alone(tmp_path):
    """examples/online_digits: scripted users talk to a gateway only; every session they give feedback for
    is pushed, and the server trains on them."""
    from tests.chaos.test_gateway_kill import GatewayProcess
    from tests.conftest import free_port

    # feedback up to 1 s late, at many updates a second: as docs/online.md says, staleness must cover it
    server = ServerProcess(
        ["--group-size", "4", "--batch-groups", "2", "--max-staleness", "64"], tmp_path / "server.log"
    )
    gateway = GatewayProcess(
        ["--server", server.url, "--spool-dir", str(tmp_path / "gw")], tmp_path / "gw.log", free_port()
    )
    try:
        script = Path(__file__).resolve().parents[2] / "examples" / "online_digits" / "users.py"
        command = [sys.executable, str(script), "--gateway", gateway.url, "--sessions", "64", "--max-delay", "1"]
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=300, env={**os.environ, "AGENTJET_DIGITS": "3,8"}
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert "sessions 64" in done.stdout and "feedback given 64, waiting 0, refused 0" in done.stdout, done.stdout
        counts = gateway.status()["counts"]
        # groups fill per prompt (two digits here): at most 3 sessions of each wait in an unfilled group, and
        # at most one filled group waits for a second to make a batch of 2
        deadline = time.monotonic() + 120
        while not settled(trajectories := server.status()["trajectories"], least_trained=64 - 2 * 3 - 4):
            assert time.monotonic() < deadline, f"the server did not accept and train them: {trajectories}"
            time.sleep(0.3)
        step = server.status()["learner"]["step"]
    finally:
        gateway.stop()
        server.stop()
    assert counts["trained"] == 64 and counts["sessions"] == 64 and counts["expired"] == 0
    assert trajectories["accepted"] == 64 and trajectories["rejected"] == 0
    assert trajectories["trained"] % 8 == 0 and step >= 1


def settled(trajectories: dict[str, Any], least_trained: int) -> bool:
    return bool(trajectories["accepted"] == 64 and trajectories["trained"] >= least_trained)
