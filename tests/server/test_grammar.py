"""Structured outputs (``engine/grammar.py``): ``response_format`` json_schema and json_object constrain the
transformers engine's sampling with xgrammar; the constrained answers parse and validate, the unconstrained
ones of the same model do not; the turn records the masked distribution's log-probs as processed."""

from __future__ import annotations

import asyncio
import json

import httpx2
import jsonschema
import openai
import pytest

from tests.conftest import LiveServer

ASK = [{"role": "user", "content": "Write seven as a digit."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "digit": {"type": "integer", "minimum": 0, "maximum": 9},
        "word": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "sure": {"type": "boolean"},
    },
    "required": ["digit", "word", "sure"],
}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "digit", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def server(model_dir):
    live = LiveServer(model_dir, default_max_tokens=48)
    yield live
    live.stop()


def valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), {**SCHEMA, "additionalProperties": False})
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


async def answers(url: str, n: int, **extra: object) -> list[dict]:  # type: ignore[type-arg]
    async with httpx2.AsyncClient(base_url=url, timeout=120) as http:
        replies = await asyncio.gather(
            *(http.post("/v1/chat/completions", json={"messages": ASK, "seed": k, **extra}) for k in range(n))
        )
    assert all(r.status_code == 200 for r in replies), [r.text[:300] for r in replies if r.status_code != 200]
    return [r.json()["choices"][0] for r in replies]


def test_json_schema_answers_parse_and_validate_and_free_ones_do_not(server):
    constrained = asyncio.run(answers(server.url, 100, response_format=JSON_SCHEMA, logprobs=True))
    free = asyncio.run(answers(server.url, 100))
    assert sum(valid(c["message"]["content"]) for c in constrained) == 100
    assert sum(valid(c["message"]["content"]) for c in free) == 0
    for choice in constrained:  # the masked distribution is the behaviour policy, recorded as processed
        ext = choice["agentjet"]
        assert ext["sampled_from"] == "processed" and choice["finish_reason"] == "stop"
        model = [entry["logprob"] for entry in choice["logprobs"]["content"]]
        assert all(b >= m - 1e-5 for b, m in zip(ext["completion_logprobs"], model, strict=True))  # mass moved in
    assert any(
        c["agentjet"]["completion_logprobs"] != [e["logprob"] for e in c["logprobs"]["content"]] for c in constrained
    )


def test_json_object_answers_that_finish_are_json_objects(server):
    finished = [c for c in asyncio.run(answers(server.url, 40, response_format={"type": "json_object"}))]
    done = [c["message"]["content"] for c in finished if c["finish_reason"] == "stop"]
    assert done and all(isinstance(json.loads(text), dict) for text in done)
    assert all(c["message"]["content"].lstrip().startswith("{") for c in finished)


def test_the_responses_api_and_text_completions_take_the_format_too(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused") as sdk:
        reply = sdk.responses.create(
            model="agentjet-tiny",
            input="Write seven as a digit.",
            max_output_tokens=48,
            text={"format": {"type": "json_schema", "name": "digit", "schema": SCHEMA, "strict": True}},
        )
        assert valid(reply.output_text)
        text = sdk.completions.create(
            model="agentjet-tiny",
            prompt="Seven:",
            max_tokens=48,
            extra_body={"response_format": JSON_SCHEMA},
        )
        assert valid(text.choices[0].text)


def test_formats_that_cannot_be_served_are_400s_naming_response_format(server, model_dir):
    bad = [
        {"type": "yaml"},
        {"type": "json_schema"},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": "not an object"}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense-type"}}},
    ]
    for response_format in bad:
        reply = httpx2.post(
            server.url + "/v1/chat/completions", json={"messages": ASK, "response_format": response_format}
        )
        assert reply.status_code == 400 and "response_format" in reply.text, (response_format, reply.text)
    exact = LiveServer(model_dir, exact_sampling=True)
    try:
        reply = httpx2.post(exact.url + "/v1/chat/completions", json={"messages": ASK, "response_format": JSON_SCHEMA})
        assert reply.status_code == 400 and "--exact-sampling" in reply.text and "response_format" in reply.text
    finally:
        exact.stop()


def test_without_xgrammar_a_format_request_is_a_400_that_says_how_to_install_it(model_dir, monkeypatch):
    from agentjet_server.engine.grammar import JSON_OBJECT, Grammars
    from agentjet_server.engine.tokens import ChatTokenizer
    from agentjet_server.errors import InvalidRequestError

    monkeypatch.setitem(__import__("sys").modules, "xgrammar", None)  # as if it were not installed
    with pytest.raises(InvalidRequestError, match=r"pip install 'agentjet-server\[structured\]'") as caught:
        Grammars(ChatTokenizer(model_dir), 1024).matcher((JSON_OBJECT, ""))
    assert caught.value.param == "response_format"
