"""The body gate (``ingest.body_gate``): a helper process judges large bodies before the server parses them,
with the verdict the server would give itself; one that dies is replaced, and meanwhile the server judges;
over HTTP a large bad body gets its 400 from the gate."""

from __future__ import annotations

import json
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time

import httpx2
import pytest
from pydantic import ValidationError

from agentjet_client.protocol import ChatCompletionRequest, CompletionRequest, TrajectoryBatch
from agentjet_server.errors import InvalidRequestError
from agentjet_server.ingest.bodies import GATE_BYTES, describe_validation_error, parse_model
from agentjet_server.ingest.body_gate import BodyGate, judge

PAD = "x" * (GATE_BYTES + 1000)  # makes a body large enough for the gate
CHATS = [
    {"messages": [{"role": "user", "content": PAD}]},
    {"messages": [{"role": "robot", "content": PAD}]},
    {"messages": [{"role": "user", "content": PAD + "\ud800"}]},
    {"messages": [{"role": "user", "content": PAD}], "temprature": 1},
]
COMPLETIONS = [
    {"prompt": PAD, "max_tokens": 2},
    {"prompt": PAD, "echo": True, "stream": True},
    {"prompt": "Hello " * 12_000, "max_tokens": 2},  # valid, but longer than the tiny model's context
]
BATCHES = [
    {"trajectories": [{"id": "t", "task_id": "g", "status": "failed", "metadata": {"note": PAD}}]},
    {"trajectories": [{"id": "t", "task_id": "g", "reward": 1.0, "metadata": {"note": PAD}}]},  # no turns
]


def encoded(body: dict) -> bytes:  # type: ignore[type-arg]
    return json.dumps(body).encode("utf-8", "surrogatepass")


@pytest.fixture
def gate():
    gate = BodyGate()
    yield gate
    gate.close()


def server_verdict(raw: bytes, model: type) -> dict | None:  # type: ignore[type-arg]
    """What the server says of a body when it judges it itself."""
    try:
        parse_model(raw, model)
    except InvalidRequestError as exc:
        return {"message": exc.message, "param": exc.param, "code": exc.code}
    except ValidationError as exc:
        message, param = describe_validation_error(exc)
        return {"message": message, "param": param, "code": "invalid_value"}
    return None


def test_a_verdict_is_none_for_a_valid_body_and_the_400_the_server_would_send_otherwise():
    verdicts = [judge(encoded(b), ChatCompletionRequest) for b in CHATS]
    assert verdicts[0] is None
    assert verdicts[1]["param"] == "messages.0.role" and verdicts[1]["code"] == "invalid_value"
    assert verdicts[2]["code"] == "invalid_unicode" and verdicts[2]["param"] == "messages"
    assert verdicts[3]["message"] == "invalid request: temprature: unknown field; remove it or check its spelling"
    assert judge(encoded(COMPLETIONS[0]), CompletionRequest) is None
    assert "echo is answered whole only" in judge(encoded(COMPLETIONS[1]), CompletionRequest)["message"]  # type: ignore[index]
    assert judge(encoded(BATCHES[0]), TrajectoryBatch) is None
    assert "at least one turn" in judge(encoded(BATCHES[1]), TrajectoryBatch)["message"]  # type: ignore[index]
    assert judge(b"[1]", TrajectoryBatch) == server_verdict(b"[1]", TrajectoryBatch)


def test_the_gate_process_answers_each_framed_body_with_one_json_line():
    frames = [
        (b"c", encoded(CHATS[0])),
        (b"c", encoded(CHATS[1])),
        (b"p", encoded(COMPLETIONS[0])),
        (b"p", encoded(COMPLETIONS[1])),
        (b"t", encoded(BATCHES[1])),
        (b"t", b"{not json"),
    ]
    stdin = b"".join(kind + struct.pack("<Q", len(raw)) + raw for kind, raw in frames)
    proc = subprocess.run(
        [sys.executable, "-m", "agentjet_server.ingest.body_gate"], input=stdin, capture_output=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr  # the end of its input ends it
    lines = proc.stdout.splitlines()
    models = {b"c": ChatCompletionRequest, b"p": CompletionRequest, b"t": TrajectoryBatch}
    assert [json.loads(line) for line in lines] == [server_verdict(raw, models[kind]) for kind, raw in frames]
    assert all(line.isascii() for line in lines)


def test_a_cut_off_frame_ends_the_gate_without_an_answer():
    raw = encoded(CHATS[0])
    stdin = b"c" + struct.pack("<Q", len(raw)) + raw[:100]
    proc = subprocess.run(
        [sys.executable, "-m", "agentjet_server.ingest.body_gate"], input=stdin, capture_output=True, timeout=60
    )
    assert proc.returncode == 0 and proc.stdout == b""


def test_the_server_side_judges_in_one_helper_process_as_the_server_would(gate):
    for body in CHATS:
        raw = encoded(body)
        assert gate.judge(raw, ChatCompletionRequest) == server_verdict(raw, ChatCompletionRequest)
    helper = gate._proc
    assert helper is not None and helper.poll() is None and helper.pid != os.getpid()
    for body in COMPLETIONS:
        raw = encoded(body)
        assert gate.judge(raw, CompletionRequest) == server_verdict(raw, CompletionRequest)
    for body in BATCHES:
        raw = encoded(body)
        assert gate.judge(raw, TrajectoryBatch) == server_verdict(raw, TrajectoryBatch)
    assert gate._proc is helper  # one process for every body
    gate.close()
    assert helper.poll() is not None and gate._proc is None
    gate.close()  # twice is fine


def test_a_body_whose_gate_dies_while_it_is_written_is_judged_by_the_server(gate, caplog):
    raw = encoded({"messages": [{"role": "robot", "content": "x" * 1_000_000}]})
    expected = server_verdict(raw, ChatCompletionRequest)
    assert gate.judge(raw, ChatCompletionRequest) == expected
    helper = gate._proc
    assert helper is not None and helper.stdin is not None
    os.kill(helper.pid, signal.SIGSTOP)  # it stops reading: the next body fills the pipe and waits
    answer: list[object] = []
    writer = threading.Thread(target=lambda: answer.append(gate.judge(raw, ChatCompletionRequest)))
    writer.start()
    deadline = time.monotonic() + 30
    while select.select([], [helper.stdin.fileno()], [], 0)[1]:  # until the pipe is full: the body is on its way
        assert time.monotonic() < deadline, "the body was never written"
        time.sleep(0.01)
    helper.kill()  # the gate dies mid-body (as the kernel's OOM killer would end it)
    writer.join(timeout=60)
    assert answer == [expected]
    assert "the body gate failed" in caplog.text and "judging this body in the server" in caplog.text
    assert gate.judge(raw, ChatCompletionRequest) == expected
    assert gate._proc is not None and gate._proc.pid != helper.pid  # a new gate for the next body


def test_a_gate_that_died_between_bodies_is_replaced_and_its_pipes_closed(gate, caplog):
    raw = encoded(CHATS[1])
    expected = server_verdict(raw, ChatCompletionRequest)
    assert gate.judge(raw, ChatCompletionRequest) == expected
    dead = gate._proc
    assert dead is not None and dead.stdin is not None and dead.stdout is not None
    dead.kill()  # between bodies (as the kernel's OOM killer would end it)
    dead.wait(timeout=30)
    assert gate.judge(raw, ChatCompletionRequest) == expected
    assert gate._proc is not None and gate._proc.pid != dead.pid and gate._proc.poll() is None
    assert dead.stdin.closed and dead.stdout.closed  # no file left open per dead gate
    assert "the body gate had stopped" in caplog.text


# a gate that answers its first body, then stops reading (closes its stdin) and lives on, as a dying one does
STOPS_READING = """
import os, struct, sys, time
header = sys.stdin.buffer.read(9)
sys.stdin.buffer.read(struct.unpack("<Q", header[1:])[0])
os.close(0)
sys.stdout.buffer.write(b"null\\n")
sys.stdout.flush()
time.sleep(60)
"""


def test_a_body_whose_gate_stopped_reading_is_judged_by_the_server(caplog):
    gate = BodyGate(command=[sys.executable, "-c", STOPS_READING])
    try:
        raw = encoded(CHATS[1])
        assert gate.judge(raw, ChatCompletionRequest) is None  # the stand-in passes its first body
        stopped = gate._proc
        assert stopped is not None and stopped.poll() is None  # alive, no longer reading
        # the header is buffered, the body's write fails (EPIPE), and closing must not flush the header again
        assert gate.judge(raw, ChatCompletionRequest) == server_verdict(raw, ChatCompletionRequest)
        assert "the body gate failed" in caplog.text and "judging this body in the server" in caplog.text
        assert stopped.poll() is not None and stopped.stdin is not None and stopped.stdin.closed
        assert gate._proc is None  # the next body starts a new gate
    finally:
        gate.close()


def test_a_large_bad_body_gets_its_400_from_the_gate(live_server):
    gate = live_server.app.state.api.gate
    r = httpx2.post(live_server.url + "/v1/chat/completions", content=encoded(CHATS[1]), timeout=60)
    assert r.status_code == 400
    error = r.json()["error"]
    assert (
        error["param"] == "messages.0.role" and error["code"] == "invalid_value" and '(got "robot")' in error["message"]
    )
    assert gate._proc is not None and gate._proc.poll() is None  # judged in the helper, which stays up
    batch = {"trajectories": [{"id": "", "task_id": "g", "status": "failed", "metadata": {"n": PAD}}]}
    r = httpx2.post(live_server.url + "/v1/trajectories", content=encoded(batch), timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "trajectories.0.id"


def test_a_large_text_completion_body_is_judged_by_the_gate_like_a_chat_body(live_server):
    gate = live_server.app.state.api.gate
    r = httpx2.post(live_server.url + "/v1/completions", content=encoded(COMPLETIONS[1]), timeout=60)
    assert r.status_code == 400, r.text
    assert "echo is answered whole only" in r.json()["error"]["message"]
    assert gate._proc is not None and gate._proc.poll() is None  # judged in the helper, which stays up
    r = httpx2.post(live_server.url + "/v1/completions", content=encoded(COMPLETIONS[2]), timeout=60)
    assert r.status_code == 400, r.text  # passed by the gate, then refused by the server as a small body is
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    assert "more than fit in the model's context" in error["message"]
