"""End to end: ``agentjet-client research auto`` driven by a scripted researcher, a local
OpenAI-compatible endpoint written for this test that answers each step of the loop with a fixed
answer: round 1 plans a partial-credit reward whose first version is broken (it must be repaired from
the check's error) and is refuted; round 2's study is derived from round 1's report (its best code
dir, read from the leaderboard the prompt carries) and is confirmed. The loop is SIGKILLed (with its
study runner) mid-round and started again: it resumes without redoing finished trials or asking
again what was answered.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from tests.conftest import CACHE

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e

AGENT = (ROOT / "examples" / "digits" / "agent.py").read_text()
EXACT = 'return 1.0 if answer == task["answer"] else 0.0'
assert EXACT in AGENT
PARTIAL = AGENT.replace(
    EXACT, 'return 1.0 if answer == task["answer"] else (0.5 if len(answer) == 1 and answer.isdigit() else 0.0)'
)
BROKEN = AGENT.replace(EXACT, 'return 1.0 if answer == task["answr"] else 0.5')  # a KeyError in every episode


def study(name: str, space: str, code_dir: str = "variants/base") -> str:
    return f"""
[study]
name = "{name}"
poll_seconds = 0.5

[trial]
episodes = 160
eval_episodes = 16

[server]
batch_groups = 4
checkpoint_every = 2

[client]
code_dir = "{code_dir}"
concurrency = 16
env = {{ AGENTJET_DIGITS = "3,8" }}

[space]
{space}

[stop]
window = 40
"""


def plan_round_1(files: str) -> dict[str, Any]:
    return {
        "hypotheses": [
            {
                "id": "h1",
                "statement": "half credit for any single digit learns the digits as well as the exact reward",
                "confirm_if": "the partial variant's eval_reward is within 0.1 of the base variant's",
                "refute_if": "it is more than 0.1 below",
            }
        ],
        "variants": {
            "base": {"files": {}},
            "partial": {"about": "half credit for a digit", "files": {"agent.py": files}},
        },
        "study": study("round 1: partial credit", '"client.code_dir" = ["variants/base", "variants/partial"]'),
    }


def plan_round_2(best_variant: str) -> dict[str, Any]:
    files = {"agent.py": PARTIAL} if best_variant == "partial" else {}
    return {
        "hypotheses": [
            {
                "id": "h2",
                "statement": f"with the {best_variant} reward, lr 3e-3 learns more than lr 1e-6 in 160 episodes",
                "confirm_if": "eval_reward at 3e-3 is at least 0.2 above 1e-6",
                "refute_if": "it is not",
            }
        ],
        "variants": {best_variant: {"files": files}},
        "study": study(
            "round 2: learning rate",
            f'"client.code_dir" = ["variants/{best_variant}"]\n"server.lr" = [3e-3, 1e-6]',
            f"variants/{best_variant}",
        ),
    }


class Scripted:
    """The researcher: an answer per step, every request kept, tokens counted with the embedded model's
    tokenizer (a real count of these texts, by a small BPE: more tokens than a hosted model's tokenizer)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: list[tuple[str, list[dict[str, str]]]] = []
        self.lock = threading.Lock()

    def answer(self, messages: list[dict[str, str]]) -> tuple[str, str]:
        last = messages[-1]["content"]
        header = last.splitlines()[0]
        match = re.match(r"\[research auto\] round (\d+): (plan|repair \d+|verdicts)", header)
        assert match, header
        number, step = int(match.group(1)), match.group(2)
        key = f"{number}:{step}"
        if key == "1:plan":
            return key, json.dumps(plan_round_1(BROKEN))
        if key == "1:repair 1":
            assert "KeyError" in last and "answr" in last, last  # repaired from the check's own error
            return key, "Fixed the key:\n```json\n" + json.dumps(plan_round_1(PARTIAL)) + "\n```"
        if key == "1:verdicts":
            verdict = {"id": "h1", "verdict": "refuted", "evidence": "partial credit trailed the exact reward"}
            return key, json.dumps({"verdicts": [verdict], "decision": "continue", "reason": "tune lr", "next": "lr"})
        if key == "2:plan":  # derived from round 1's report: its leaderboard's best code dir
            best = re.search(r"^\| 1 \| t00\d \| ([a-z]+) \|", last, flags=re.MULTILINE)
            assert best and "## Leaderboard" in last and "h1 refuted" in last, last[-3000:]
            return key, json.dumps(plan_round_2(best.group(1)))
        if key == "2:verdicts":
            verdict = {"id": "h2", "verdict": "confirmed", "evidence": "3e-3 above 1e-6 by more than 0.2"}
            return key, json.dumps(
                {"verdicts": [verdict], "decision": "stop", "reason": "answered", "next": "more digits"}
            )
        raise AssertionError(f"unexpected step {key}")

    def handle(self, body: dict[str, Any]) -> dict[str, Any]:
        key, text = self.answer(body["messages"])
        with self.lock:
            self.requests.append((key, body["messages"]))
        prompt = sum(len(self.tokenizer.encode(m["content"]).ids) for m in body["messages"])
        completion = len(self.tokenizer.encode(text).ids)
        return {
            "id": f"scripted-{len(self.requests)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
        }


def serve(scripted: Scripted) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            try:
                answer, code = scripted.handle(body), 200
            except AssertionError as exc:
                answer, code = {"error": {"message": f"scripted researcher: {exc}"[:2000]}}, 400
            data = json.dumps(answer).encode()
            self.send_response(code)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def start(out: Path, url: str, log: Path) -> subprocess.Popen[bytes]:
    command = [
        sys.executable,
        "-m",
        "agentjet_client",
        "research",
        "auto",
        "--topic",
        "how the reward shapes digit learning",
    ]
    command += ["--code-dir", str(ROOT / "examples" / "digits"), "--out", str(out), "--llm-url", url]
    command += ["--llm-model", "scripted", "--rounds", "3", "--trials", "6"]
    with log.open("ab") as f:
        return subprocess.Popen(command, stdout=f, stderr=f, env={**os.environ, "AGENTJET_CACHE_DIR": str(CACHE)})


def leftovers(out: Path) -> list[str]:
    """Live processes whose command line names the research directory."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace").replace("\0", " ")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if str(out) in cmdline and state != "Z":
            found.append(cmdline)
    return found


def trial(out: Path, round_: int, trial_id: str) -> dict[str, Any]:
    path = out / "rounds" / f"r{round_:02d}" / "study" / "trials" / trial_id / "trial.json"
    for _ in range(100):
        try:
            return json.loads(path.read_text())  # type: ignore[no-any-return]
        except (FileNotFoundError, json.JSONDecodeError):
            time.sleep(0.05)
    return {}


def test_research_auto_plans_repairs_runs_judges_two_rounds_and_resumes_after_a_kill(tmp_path, model_dir):
    scripted = Scripted(Tokenizer.from_file(str(model_dir / "tokenizer.json")))
    http = serve(scripted)
    url = f"http://127.0.0.1:{http.server_address[1]}/v1"
    out, log = tmp_path / "auto", tmp_path / "auto.log"
    process = start(out, url, log)
    try:
        deadline = time.monotonic() + 600
        while not (trial(out, 2, "t000").get("phase") == "done" and trial(out, 2, "t001").get("phase") == "training"):
            assert process.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.2)
        finished = (out / "rounds" / "r02" / "study" / "trials" / "t000" / "trial.json").read_text()
        runner = json.loads((out / "rounds" / "r02" / "study" / "study.json").read_text())["runner_pid"]
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
        os.kill(runner, signal.SIGKILL)
        asked = [key for key, _ in scripted.requests]
        process = start(out, url, log)
        assert process.wait(timeout=600) == 0, log.read_text()[-4000:]
    finally:
        if process.poll() is None:
            process.kill()
        http.shutdown()
        http.server_close()

    assert not leftovers(out), "processes of the research outlived it (a check server of the killed loop?)"
    keys = [key for key, _ in scripted.requests]
    assert asked == ["1:plan", "1:repair 1", "1:verdicts", "2:plan"]
    assert keys == [*asked, "2:verdicts"]  # nothing asked twice across the kill
    text = log.read_text()
    assert "continuing the research" in text and "round 2: continuing its study" in text, text[-3000:]
    # round 2's finished trial was kept as it was; the one killed mid-run was resumed, not restarted
    assert (out / "rounds" / "r02" / "study" / "trials" / "t000" / "trial.json").read_text() == finished
    server_log = (out / "rounds" / "r02" / "study" / "trials" / "t000" / "server.log").read_text()
    assert server_log.count(" up --config ") == 1
    assert trial(out, 2, "t001")["status"] == "finished"

    state = json.loads((out / "auto.json").read_text())
    first, second = state["rounds"]
    assert first["attempts"] == 2 and "KeyError" in first["problems"][0][0] and first["phase"] == "done"
    assert [v["verdict"] for v in first["verdicts"]] == ["refuted"]
    assert [v["verdict"] for v in second["verdicts"]] == ["confirmed"] and second["decision"] == "stop"
    assert state["finished"].startswith("the researcher stopped after round 2")
    assert state["usage"]["calls"] == 5 and state["usage"]["prompt"] > 0 and state["usage"]["completion"] > 0
    # generated code ran in its own working directory, inside the out dir; the user's code is untouched
    assert (out / "rounds" / "r01" / "checks" / "partial" / "try.log").exists()
    assert (ROOT / "examples" / "digits" / "agent.py").read_text() == AGENT
    findings = (out / "findings.md").read_text()
    for needle in (
        "# Findings: how the reward shapes digit learning",
        "**refuted**",
        "**confirmed**",
        "## Best configuration",
        "## What failed",
        "plan 1 failed its checks (repaired)",
        "KeyError",
        "## What to try next",
        "more digits",
        "rounds/r01/study/plots/metric_vs_client.code_dir.png",
        "- code dir: `rounds/r0",
    ):
        assert needle in findings, needle
    lines = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    assert sum(x["kind"] == "answer" for x in lines) == 5 and sum(x["kind"] == "ask" for x in lines) == 5
    (tmp_path / "usage.json").write_text(json.dumps(state["usage"]))  # the figure docs/research.md reports
