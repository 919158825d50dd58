"""The researcher's endpoint, OpenAI or Anthropic style: what is sent, the answer read back, its tokens
counted, a failing endpoint named with what to check; and JSON read from an answer however it is wrapped."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from agentjet_client.errors import StudyError
from agentjet_client.research.researcher import Researcher, json_answer


class Endpoint:
    """A local endpoint that answers chat completions and messages, and keeps what it was sent."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, Any], str]] = []
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                key = self.headers.get("authorization") or self.headers.get("x-api-key") or ""
                endpoint.seen.append((self.path, body, key))
                if self.path.endswith("/chat/completions"):
                    answer: dict[str, Any] = {
                        "id": "c1",
                        "object": "chat.completion",
                        "created": 0,
                        "model": body["model"],
                        "choices": [
                            {
                                "index": 0,
                                "message": {"role": "assistant", "content": '{"a": 1}'},
                                "finish_reason": "stop",
                            }
                        ],
                        "usage": {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14},
                    }
                elif self.path.endswith("/messages"):
                    answer = {
                        "id": "m1",
                        "type": "message",
                        "role": "assistant",
                        "model": body["model"],
                        "content": [{"type": "text", "text": '{"b": 2}'}],
                        "stop_reason": "end_turn",
                        "usage": {"input_tokens": 20, "output_tokens": 4},
                    }
                else:
                    self.send_response(404)
                    self.end_headers()
                    return
                data = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def endpoint():
    served = Endpoint()
    yield served
    served.close()


def test_openai_style_sends_the_system_prompt_and_turns_and_counts_tokens(endpoint, monkeypatch):
    monkeypatch.setenv("AGENTJET_RESEARCH_API_KEY", "research-key")
    researcher = Researcher(endpoint.url + "/v1", "some-model")
    assert researcher.ask("be brief", [{"role": "user", "content": "plan"}], max_tokens=100) == '{"a": 1}'
    path, body, key = endpoint.seen[-1]
    assert path == "/v1/chat/completions" and key == "Bearer research-key"
    assert body["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "plan"}]
    assert body["model"] == "some-model" and body["max_completion_tokens"] == 100 and body["temperature"] == 0
    researcher.ask("be brief", [{"role": "user", "content": "again"}])
    assert researcher.usage.as_dict() == {"prompt": 22, "completion": 6, "calls": 2}


def test_anthropic_style_sends_a_messages_request(endpoint, monkeypatch):
    monkeypatch.delenv("AGENTJET_RESEARCH_API_KEY", raising=False)
    monkeypatch.setenv("ANTHROPIC_API_KEY", "anthropic-key")
    researcher = Researcher(endpoint.url, "claude-x", style="anthropic")
    assert researcher.ask("be brief", [{"role": "user", "content": "plan"}], max_tokens=50) == '{"b": 2}'
    path, body, key = endpoint.seen[-1]
    assert path == "/v1/messages" and key.removeprefix("Bearer ") == "anthropic-key"
    assert body["system"] == "be brief" and body["messages"] == [{"role": "user", "content": "plan"}]
    assert body["max_tokens"] == 50 and researcher.usage.as_dict() == {"prompt": 20, "completion": 4, "calls": 1}


def test_an_endpoint_that_fails_is_an_error_that_says_what_to_check():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    researcher = Researcher(f"http://127.0.0.1:{port}/v1", "m", timeout=5)
    researcher.client().max_retries = 0
    with pytest.raises(StudyError, match="check --llm-url, --llm-model and the key"):
        researcher.ask("s", [{"role": "user", "content": "x"}])
    assert researcher.usage.calls == 0


@pytest.mark.parametrize(
    "text",
    ['{"x": 1}', 'Here it is:\n```json\n{"x": 1}\n```\nDone.', 'Sure. {"x": 1} That is all.', '```\n{"x": 1}\n```'],
)
def test_json_is_read_from_an_answer_however_it_is_wrapped(text):
    assert json_answer(text) == {"x": 1}


@pytest.mark.parametrize(
    ("text", "message"), [("no json here", "no JSON"), ("[1, 2]", "not an object"), ('{"x": }', "does not parse")]
)
def test_an_answer_without_a_json_object_says_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=message):
        json_answer(text)
