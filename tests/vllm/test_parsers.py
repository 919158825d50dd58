"""Tool and reasoning parsers per model family, against vLLM's own OpenAI server.

For each family (Qwen3 with thinking, Llama 3.1 JSON tool calls, Mistral ``[TOOL_CALLS]``) a tiny
model built with the family's special tokens and a template in its format (``families``) is
served twice: by ``agentjet-server up --tool-call-parser X --reasoning-parser Y`` and by
``vllm serve`` with the same parsers. The same request, with the same seed, must come back with
the same ``tool_calls``, ``reasoning`` and content from both.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx2
import pytest

from tests.conftest import ServerProcess, free_port, wait_healthy
from tests.vllm.families import ASK_PLAIN, ASK_TOOL, FAMILIES, TOOLS, build

pytest.importorskip("vllm")
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


class VLLMOpenAIServer:
    """``vllm serve`` (vLLM's own OpenAI server) as a process on loopback."""

    def __init__(self, model: Path, log: Path, tool_parser: str | None, reasoning_parser: str | None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
        args += ["--port", str(self.port), "--host", "127.0.0.1", "--max-model-len", "1024", "--dtype", "float32"]
        args += ["--seed", "0", "--enforce-eager", "--served-model-name", "family"]
        if tool_parser:
            args += ["--tool-call-parser", tool_parser, "--enable-auto-tool-choice"]
        if reasoning_parser:
            args += ["--reasoning-parser", reasoning_parser]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
        self._log, self._log_path = log.open("a"), log
        self.proc = subprocess.Popen(args, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def wait(self) -> None:
        """Until it serves (it starts in the background: the other server starts meanwhile)."""
        wait_healthy(self.proc, self.url + "/health", self._log_path, 300, poll=0.5)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()


EVERY_FAMILY = pytest.mark.parametrize("pair", sorted(FAMILIES), indirect=True)
# reasoning, and what does not depend on the family, are checked on Qwen3 alone
QWEN3 = pytest.mark.parametrize("pair", ["qwen3"], indirect=True)


@pytest.fixture(scope="module")
def pair(request, tmp_path_factory):
    """(family, our server, vLLM's server), both on the family's tiny model with its parsers."""
    family = FAMILIES[request.param]
    root = tmp_path_factory.mktemp(family.name)
    model = build(family, root / "model")
    flags = ["--model", str(model), "--model-name", "family"]
    if family.tool_parser:
        flags += ["--tool-call-parser", family.tool_parser]
    if family.reasoning_parser:
        flags += ["--reasoning-parser", family.reasoning_parser]
    # vLLM's server starts first and boots while ours starts (two cores: half the wait)
    theirs = VLLMOpenAIServer(model, root / "vllm.log", family.tool_parser, family.reasoning_parser)
    try:
        ours = ServerProcess(flags, root / "ours.log")
    except BaseException:
        theirs.stop()
        raise
    try:
        theirs.wait()
    except BaseException:
        ours.stop()
        theirs.stop()
        raise
    yield family, ours, theirs
    theirs.stop()
    ours.stop()


def _chat(url: str, messages, tools, **extra):  # type: ignore[no-untyped-def]
    body = {"model": "family", "messages": messages, "max_tokens": 80, "temperature": 0, "seed": 3, **extra}
    if tools:
        body["tools"] = tools
    reply = httpx2.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]


def _read(message):  # type: ignore[no-untyped-def]
    """What the agent is shown: reasoning, content, and the calls (ids are random on both sides)."""
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls") or []]
    return message.get("reasoning"), message.get("content"), calls


@EVERY_FAMILY
def test_tool_calls_and_reasoning_equal_vllms_own_server(pair):
    family, ours, theirs = pair
    for messages, tools, completion in family.cases:
        mine, vllm = _chat(ours.url, messages, tools), _chat(theirs.url, messages, tools)
        assert mine["agentjet"]["completion_token_ids"]  # both sampled the family's answer
        assert _read(mine["message"]) == _read(vllm["message"]), (family.name, completion)
        assert mine["finish_reason"] == vllm["finish_reason"]
        reasoning, _, calls = _read(mine["message"])
        assert bool(calls) == ("get_weather" in completion)  # the case's calls were found, not only matched
        assert (reasoning is not None) == (family.reasoning_parser is not None)
        if reasoning is not None:
            assert mine["message"]["reasoning_content"] == reasoning  # the earlier name, which most clients read


@EVERY_FAMILY
def test_streamed_answer_reads_as_the_whole_one(pair):
    family, ours, _ = pair
    for messages, tools, _ in family.cases:
        whole = _chat(ours.url, messages, tools)
        body = {"model": "family", "messages": messages, "max_tokens": 80, "temperature": 0, "seed": 3, "stream": True}
        if tools:
            body["tools"] = tools
        reasoning, content, calls, ids = "", "", [], None
        with httpx2.stream("POST", ours.url + "/v1/chat/completions", json=body, timeout=120) as reply:
            for line in reply.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for choice in json.loads(line[6:])["choices"]:
                    delta = choice["delta"]
                    reasoning += delta.get("reasoning") or ""
                    content += delta.get("content") or ""
                    calls += delta.get("tool_calls") or []
                    if choice.get("agentjet"):
                        ids = choice["agentjet"]["completion_token_ids"]
        assert ids == whole["agentjet"]["completion_token_ids"]
        want_reasoning, want_content, want_calls = _read(whole["message"])
        assert (reasoning or None) == want_reasoning
        assert content.strip() == (want_content or "").strip()  # vLLM's stream may keep whitespace it drops whole
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == want_calls


@QWEN3
def test_reasoning_is_trained_and_shown_in_every_api(pair):
    _, ours, _ = pair
    choice = _chat(ours.url, ASK_PLAIN, None)
    tokens = choice["agentjet"]["completion_token_ids"]  # what the turn trains: the reasoning too
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(Path(ours.log_path).parent / "model"))
    assert tok.decode(tokens).startswith("<think>") and "Hello there!" in tok.decode(tokens)
    reasoning = choice["message"]["reasoning"]
    assert reasoning.strip() == "A greeting."

    message = httpx2.post(
        ours.url + "/v1/messages", json={"model": "family", "max_tokens": 80, "temperature": 0, "messages": ASK_PLAIN}
    ).json()
    assert message["content"][0] == {"type": "thinking", "thinking": reasoning, "signature": ""}
    assert message["content"][1]["type"] == "text" and "Hello there!" in message["content"][1]["text"]

    response = httpx2.post(
        ours.url + "/v1/responses",
        json={"model": "family", "input": ASK_PLAIN[0]["content"], "max_output_tokens": 80, "temperature": 0},
    ).json()
    kinds = [item["type"] for item in response["output"]]
    assert kinds == ["reasoning", "message"]
    assert response["output"][0]["content"][0]["text"] == reasoning


@QWEN3
def test_a_template_that_drops_earlier_reasoning_starts_a_new_timeline(pair):
    _, ours, _ = pair
    first = _chat(ours.url, ASK_TOOL, TOOLS)
    ext = first["agentjet"]
    call = first["message"]["tool_calls"][0]
    claim = {
        "prefix_token_ids": ext["prompt_token_ids"] + ext["completion_token_ids"],
        "prefix_prompt_tokens": len(ext["prompt_token_ids"]),
    }
    answered = {"role": "assistant", "content": first["message"].get("content"), "tool_calls": [call]}
    result = {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}
    before = ours.status()["context"]
    # the same user turn goes on (a tool loop): the template keeps the reasoning, the timeline goes on
    loop = _chat(ours.url, [*ASK_TOOL, answered, result], TOOLS, agentjet=claim)
    assert loop["agentjet"]["prefix"] in ("extended", "spliced")
    assert loop["agentjet"]["prompt_token_ids"][: len(claim["prefix_token_ids"])] == claim["prefix_token_ids"]
    # a new user turn: this template leaves the earlier reasoning out, so the history is rendered afresh
    later = _chat(ours.url, [*ASK_TOOL, answered, result, *ASK_PLAIN], TOOLS, agentjet=claim)
    assert later["agentjet"]["prefix"] == "reasoning_dropped"
    after = ours.status()["context"]
    assert after["reasoning_dropped"] == before["reasoning_dropped"] + 1
    assert after["mismatch"] == before["mismatch"]


@QWEN3
def test_the_vllm_engine_reads_answers_as_the_transformers_engine_does(pair, tmp_path):
    """The parser sits above the engine: ``--engine vllm`` shows the agent the same answers."""
    family, ours, _ = pair
    model = Path(ours.log_path).parent / "model"
    flags = ["--model", str(model), "--model-name", "family", "--engine", "vllm"]
    flags += ["--tool-call-parser", family.tool_parser, "--reasoning-parser", family.reasoning_parser]
    other = ServerProcess(flags, tmp_path / "vllm-engine.log")
    try:
        for messages, tools, _ in family.cases:
            mine, theirs = _chat(ours.url, messages, tools), _chat(other.url, messages, tools)
            assert theirs["agentjet"]["completion_token_ids"] == mine["agentjet"]["completion_token_ids"]
            assert _read(theirs["message"]) == _read(mine["message"])
    finally:
        other.stop()
