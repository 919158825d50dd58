"""Request bodies (``ingest.bodies``): read within a size limit (413) and a time limit (408), parsed as a JSON
object, its shape checked (depth, valid Unicode) and validated, each refusal a 4xx that says what is wrong and
where; the reading on a real server on loopback, the parsing and checking on hand-made bodies."""

from __future__ import annotations

import json
import socket

import httpx2
import pytest
from pydantic import ValidationError

from agentjet_client.protocol import ChatCompletionRequest, Trajectory, TrajectoryBatch
from agentjet_server.errors import InvalidRequestError
from agentjet_server.ingest.bodies import (
    SHOWN_CHARACTERS,
    SHOWN_PROBLEMS,
    check_shape,
    describe_validation_error,
    parse_json,
    parse_model,
)
from tests.conftest import LiveServer

CHAT_LIMIT = 4096


@pytest.fixture(scope="module")
def small(model_dir):
    """A server whose inference bodies may hold 4 KiB and must arrive within a second."""
    server = LiveServer(model_dir, max_chat_body_bytes=CHAT_LIMIT, body_timeout_s=1.0)
    yield server
    server.stop()


def refusal(raw: bytes) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as caught:
        parse_json(raw)
    return caught.value


@pytest.mark.parametrize(
    ("raw", "says", "code"),
    [
        (b"", "request body is empty", None),
        (b"{not json", "request body is not valid JSON", "invalid_json"),
        (b'{"n": ' + b"9" * 4301 + b"}", "request body is not valid JSON", "invalid_json"),  # int of 4301 digits
        (b'{"a": "\xff\xfe"}', "request body is not valid JSON", "invalid_json"),  # not UTF-8
        (b"[1, 2]", "must be a JSON object, not list", None),
        (b'"text"', "must be a JSON object, not str", None),
        (b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply to parse", "too_deep"),
    ],
)
def test_a_body_that_is_not_a_json_object_is_refused_with_the_reason(raw, says, code):
    error = refusal(raw)
    assert says in error.message and error.code == code and error.status_code == 400


def test_json_nested_deeper_than_the_bound_is_refused_naming_where():
    check_shape({"a": {"b": {"c": 1}}}, max_depth=2)  # three objects: the root and two below it
    with pytest.raises(InvalidRequestError) as caught:
        check_shape({"a": {"b": {"c": 1}}}, max_depth=1)
    assert caught.value.message.startswith("a.b: JSON nested deeper than 1 levels")
    assert caught.value.param == "a" and caught.value.code == "too_deep"
    tools = {"tools": [{"function": {"parameters": json.loads("[" * 70 + "]" * 70)}}]}
    with pytest.raises(InvalidRequestError, match=r"^tools\.0\.function\.parameters.*deeper than 64 levels"):
        parse_json(json.dumps(tools).encode())


@pytest.mark.parametrize(
    ("body", "where", "param"),
    [
        ({"messages": [{"role": "user", "content": "ok \ud800"}]}, "messages.0.content", "messages"),
        ({"metadata": {"\udfff": 1}}, "metadata", "metadata"),  # in a key: named by the object that holds it
        ({"ids": [1, 2, "a\udbffb"]}, "ids.2", "ids"),  # a list of numbers with text among them is walked
    ],
)
def test_a_lone_surrogate_is_refused_naming_its_field_and_position(body, where, param):
    with pytest.raises(InvalidRequestError) as caught:
        check_shape(body)
    error = caught.value
    assert error.message.startswith(f"{where}: text holds a lone UTF-16 surrogate")
    assert error.param == param and error.code == "invalid_unicode"


def test_a_surrogate_sent_as_raw_bytes_is_refused_like_its_escape():
    escaped = refusal(b'{"messages": [{"role": "user", "content": "\\ud800"}]}')
    raw = refusal(b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}]}')  # what surrogatepass writes
    assert raw.message == escaped.message and "'\\ud800' at character 0" in raw.message


def problems(data: dict) -> tuple[list[str], str | None, int]:  # type: ignore[type-arg]
    with pytest.raises(ValidationError) as caught:
        ChatCompletionRequest.model_validate(data)
    message, first = describe_validation_error(caught.value)
    assert message.startswith("invalid request: ")
    return message.removeprefix("invalid request: ").split("; "), first, caught.value.error_count()


def test_a_validation_error_names_its_first_few_problems_and_counts_the_rest():
    parts, first, count = problems({"messages": [{"role": "robot", "content": "hi"}] * 8, "max_tokens": "x"})
    assert count == 9 and len(parts) == SHOWN_PROBLEMS + 1 and parts[-1] == "... and 4 more problems"
    assert first == "messages.0.role" and parts[0].startswith("messages.0.role: Input should be 'system'")
    assert parts[0].endswith('(got "robot")')


def test_each_problem_says_what_is_wrong_and_shows_what_was_sent_briefly():
    parts, first, _ = problems({"temprature": 0.5, "max_tokens": "x" * 200, "stop": [{"a": 1}] * 3})
    assert first == "messages" and parts[0] == "messages: required field is missing"
    [tokens] = [p for p in parts if p.startswith("max_tokens: ")]
    assert tokens.endswith(' (got "' + "x" * SHOWN_CHARACTERS + '"...)')  # the text sent: cut, quoted, marked
    assert "stop.str: Input should be a valid string (got a list of 3 items)" in parts  # containers by size
    assert "stop.list[str].0: Input should be a valid string (got a JSON object of 1 items)" in parts
    parts, first, _ = problems({"messages": [{"role": "user", "content": "hi"}], "temprature": 0.5})
    assert "; ".join(parts) == "temprature: unknown field; remove it or check its spelling"
    assert first == "temprature"
    [temperature], _, _ = problems({"messages": [{"role": "user", "content": "hi"}], "temperature": 10**100})
    assert temperature.endswith(" (got 1" + "0" * (SHOWN_CHARACTERS - 1) + "...)")  # a number as written, cut
    [temperature], _, _ = problems({"messages": [{"role": "user", "content": "hi"}], "temperature": 9})
    assert temperature.endswith(" (got 9)")  # shown whole where short


def test_a_batch_is_validated_trajectory_by_trajectory_up_to_the_first_bad_one():
    good = {"id": "t0", "task_id": "g", "status": "failed"}
    broken = {"id": "", "task_id": "", "reward": "high", "status": "failed"}
    raw = json.dumps({"trajectories": [good, good | {"id": "t1"}, broken, *[broken] * 500]}).encode()
    with pytest.raises(ValidationError) as caught:
        parse_model(raw, TrajectoryBatch)
    locs = [e["loc"] for e in caught.value.errors()]
    assert all(loc[:2] == ("trajectories", 2) for loc in locs) and len(locs) == 3  # the first bad item, whole
    batch = parse_model(json.dumps({"trajectories": [good, good | {"id": "t1"}]}).encode(), TrajectoryBatch)
    assert [t.id for t in batch.trajectories] == ["t0", "t1"] and isinstance(batch.trajectories[0], Trajectory)


def test_a_declared_length_over_the_limit_is_413_before_the_body_is_read(small):
    with socket.create_connection(("127.0.0.1", small.port)) as sock:
        head = "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        sock.sendall(f"{head}Content-Length: {10**9}\r\n\r\n".encode())  # and never a byte of the body
        sock.settimeout(10)
        answer = b""
        while b"}}" not in answer and (chunk := sock.recv(65536)):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413")
    error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
    assert error["code"] == "payload_too_large" and f"the limit is {CHAT_LIMIT} bytes" in error["message"]


def test_an_oversized_body_is_413(small):
    big = {"messages": [{"role": "user", "content": "x" * (CHAT_LIMIT + 10)}]}
    r = httpx2.post(small.url + "/v1/chat/completions", json=big, timeout=30)
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]


def test_a_body_of_no_declared_length_is_cut_off_at_the_limit(small):
    def chunks():  # chunked transfer: the size is known only as the bytes come
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'"}]}'

    r = httpx2.post(small.url + "/v1/chat/completions", content=chunks(), timeout=30)
    assert r.status_code == 413
    assert r.json()["error"]["message"] == f"request body exceeds the limit of {CHAT_LIMIT} bytes. Send smaller batches"
    fits = httpx2.post(
        small.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
        timeout=30,
    )
    assert fits.status_code == 200


def test_a_body_that_never_arrives_gets_408(small):
    with socket.create_connection(("127.0.0.1", small.port)) as sock:
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        sock.sendall(head + b'Content-Length: 100\r\n\r\n{"messages"')
        sock.settimeout(10)
        answer = b""
        while b"}}" not in answer and (chunk := sock.recv(65536)):  # the whole error body
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive within 1s (11 bytes came)" in answer
