"""verifiers environments, written here as modules the way the Environments Hub packages them
(``load_environment``), trained unchanged through ``agentjet-client run --env verifiers:MODULE``: the
environment's dataset, its own rollout (one turn, or its multi-turn protocol) and its rubric, every model
call captured token-exact, none drifting."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from agentjet_client.protocol import Trajectory
from agentjet_server.ingest.wal import Accepted, read_records
from tests.conftest import ServerProcess
from tests.e2e.drift import assert_no_drift

pytestmark = pytest.mark.e2e

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
EPISODES = 64

# one model answer per row; two weighted reward functions
SINGLE = """
import verifiers as vf
from datasets import Dataset

WORDS = {words!r}


def load_environment(digits="3,8"):
    rows = [
        {{"prompt": [{{"role": "user", "content": f"Write {{WORDS[int(d)]}} as a digit."}}], "answer": d}}
        for d in digits.split(",")
    ]

    def exact(completion, answer) -> float:
        return 1.0 if completion[-1]["content"].strip() == answer else 0.0

    def short(completion) -> float:
        return 1.0 if len(completion[-1]["content"].strip()) == 1 else 0.0

    rubric = vf.Rubric(funcs=[exact, short], weights=[1.0, 0.1])
    return vf.SingleTurnEnv(dataset=Dataset.from_list(rows), rubric=rubric)
"""

# three turns: the environment answers each reply with the next word to write
MULTI = """
import verifiers as vf
from datasets import Dataset

WORDS = {words!r}


class Countdown(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        asked = state.setdefault("asked", [int(state["answer"])])
        nxt = (asked[-1] + 5) % 10
        asked.append(nxt)
        return [{{"role": "user", "content": f"Write {{WORDS[nxt]}} as a digit."}}]


def load_environment(digits="3,8"):
    rows = [
        {{"prompt": [{{"role": "user", "content": f"Write {{WORDS[int(d)]}} as a digit."}}], "answer": d}}
        for d in digits.split(",")
    ]

    def right_share(completion, state) -> float:
        replies = [m["content"].strip() for m in completion if m["role"] == "assistant"]
        asked = state.get("asked", [int(state["answer"])])
        return sum(r == str(a) for r, a in zip(replies, asked)) / 3

    return Countdown(dataset=Dataset.from_list(rows), rubric=vf.Rubric(funcs=[right_share]), max_turns=3)
"""

# a reward function with a bug: verifiers logs it and scores 0; the episode must fail instead
BROKEN = """
import verifiers as vf
from datasets import Dataset


def load_environment():
    rows = [{"prompt": [{"role": "user", "content": "Write three as a digit."}], "answer": "3"}]

    def buggy(completion, answer) -> float:
        return 1.0 if completion[-1]["content"].strip() == answer["digit"] else 0.0

    return vf.SingleTurnEnv(dataset=Dataset.from_list(rows), rubric=vf.Rubric(funcs=[buggy]))
"""


def run_env(module: str, text: str, tmp_path: Path, server: ServerProcess, episodes: int, *extra: str):
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(text))
    exe = str(Path(sys.executable).parent / "agentjet-client")
    command = [exe, "run", "--env", f"verifiers:{module}", "--server", server.url, "--episodes", str(episodes)]
    command += ["--group-size", "8", "--seed", "0", "--spool-dir", str(tmp_path / "spool"), *extra]
    env = {**os.environ, "VF_LOG_LEVEL": "WARNING"}
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("kind", ["single", "multi"])
def test_a_verifiers_environment_trains_unchanged(kind, model_dir, tmp_path):
    state = tmp_path / "state"
    args = ["--batch-groups", "1", "--group-size", "8", "--default-max-tokens", "4", "--checkpoint-every", "0"]
    args += ["--state-dir", str(state)]
    server = ServerProcess(args, tmp_path / "s.log")
    try:
        module = f"vf_digits_{kind}"
        run = run_env(module, (SINGLE if kind == "single" else MULTI).format(words=WORDS), tmp_path, server, EPISODES)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        status = server.wait_trained()
        records = list(read_records(state / "log"))
    finally:
        server.stop()
    counts = status["trajectories"]
    assert counts["accepted"] == EPISODES and counts["rejected"] == 0 and status["policy_version"] >= 1
    trajectories = [Trajectory.model_validate(r.trajectory) for r in records if isinstance(r, Accepted)]
    assert {t.metadata["task"] for t in trajectories} == {"example-0", "example-1"}
    figures = assert_no_drift(trajectories, status, model_dir, tmp_path / "s.log")
    # verifiers ends a rollout in an error when the model answers nothing (the untrained model, now and then):
    # that episode fails with verifiers' error, as any agent's error fails its episode
    failed = [t for t in trajectories if t.status != "complete"]
    assert all("the verifiers rollout failed" in (t.error or "") for t in failed), [t.error for t in failed]
    assert len(failed) <= EPISODES // 8, [t.error for t in failed]
    for trajectory in (t for t in trajectories if t.status == "complete"):
        components = trajectory.metadata["reward_components"]
        if kind == "single":  # the rubric's weighted sum, each function a component
            assert len(trajectory.turns) == 1 and set(components) == {"exact", "short"}
            assert trajectory.reward == pytest.approx(components["exact"] + 0.1 * components["short"])
        else:  # the environment's protocol: three model turns, each continuing the one before
            assert len(trajectory.turns) == 3 and set(components) == {"right_share"}
            assert trajectory.reward == pytest.approx(components["right_share"])
            asked = [t.request_messages[-1]["content"] for t in trajectory.turns]
            first = WORDS.index(asked[0].split()[1])
            assert asked[1:] == [f"Write {WORDS[(first + 5 * k) % 10]} as a digit." for k in (1, 2)]
    if kind == "multi":  # each turn after the first continues the one before (a failed one may end early)
        assert figures["continued"] == figures["turns"] - EPISODES and figures["edited"] == figures["retooled"] == 0
        assert figures["continued"] >= 2 * (EPISODES - len(failed))
    print(
        f"verifiers {kind}-turn: {EPISODES} episodes accepted, policy v{status['policy_version']}, "
        f"{figures['turns']} turns verified, {figures['continued']} continued calls, 0 drift, "
        f"{len(failed)} failed with verifiers' error"
    )


def test_a_raising_reward_function_fails_the_episode(model_dir, tmp_path):
    """verifiers catches a reward function's error, logs it and scores 0: the episode fails with it instead."""
    server = ServerProcess(["--default-max-tokens", "4", "--group-size", "8"], tmp_path / "s.log")
    try:
        run = run_env("vf_broken", BROKEN, tmp_path, server, 8)
        status = server.status()
    finally:
        server.stop()
    said = " ".join((run.stdout + run.stderr).split())
    # the client's stop rule ends a run whose every episode fails, with the error, before anything trains
    assert run.returncode == 3 and "error: the run stopped: every one of the first" in said, said[-3000:]
    assert "the verifiers rollout failed: Error calling reward function buggy: string indices" in said
    assert status["trajectories"]["trained"] == 0 and status["policy_version"] == 0


def test_env_args_are_a_json_object_for_a_verifiers_environment(tmp_path):
    exe = str(Path(sys.executable).parent / "agentjet-client")
    for spec, args, said in [
        ("verifiers:vf_none", "[1, 2]", "--env-args takes a JSON object"),
        ("verifiers:vf_none", "{difficulty: 2}", "--env-args takes a JSON object"),
        ("gymnasium:CartPole-v1", "{}", "--env-args go to a verifiers environment's load_environment"),
        ("verifiers:vf_none", "{}", "Could not import 'vf_none' environment"),
    ]:
        run = subprocess.run(
            [exe, "run", "--env", spec, "--env-args", args, "--server", "http://127.0.0.1:9"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert run.returncode == 2 and said in " ".join(run.stderr.split()), (spec, args, run.stderr[-2000:])
