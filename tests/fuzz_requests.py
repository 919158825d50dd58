"""Hostile and broken request bodies for both POST endpoints: named cases and hypothesis strategies.

Shared by ``tests/server/test_fuzz.py`` (a few hundred generated cases per run) and
``bench/fuzz.py`` (thousands, with counts). Every answer must be below 500, on a connection that
stays up, with every 4xx in OpenAI's error shape and every stream ending in ``[DONE]``.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any

import httpx2
from hypothesis import strategies as st

CHAT, TRAJECTORIES = "/v1/chat/completions", "/v1/trajectories"
BASE_CHAT: dict[str, Any] = {"model": "agentjet-tiny", "messages": [{"role": "user", "content": "Say one."}]}


def base_turn() -> dict[str, Any]:
    return {
        "policy_version": 0,
        "prompt_token_ids": [1, 2, 3],
        "completion_token_ids": [5, 6],
        "completion_logprobs": [-1.0, -0.5],
        "finish_reason": "stop",
    }


def base_batch() -> dict[str, Any]:
    return {"trajectories": [{"id": "fz-0", "task_id": "fz", "turns": [base_turn()], "reward": 1.0}]}


def nested(depth: int, leaf: Any = 1) -> Any:
    value = leaf
    for _ in range(depth):
        value = {"a": value}
    return value


def raw(data: Any) -> bytes:
    """JSON as a client might send it: lone surrogates become raw UTF-8-style bytes (ED A0 80)."""
    return json.dumps(data, ensure_ascii=False).encode("utf-8", "surrogatepass")


def chat_with(**fields: Any) -> bytes:
    return json.dumps({**BASE_CHAT, **fields}).encode()


def batch_with_turn(**fields: Any) -> bytes:
    batch = base_batch()
    batch["trajectories"][0]["turns"][0].update(fields)
    return json.dumps(batch).encode()


def batch_with(**fields: Any) -> bytes:
    batch = base_batch()
    batch["trajectories"][0].update(fields)
    return json.dumps(batch).encode()


DEEP_SCHEMA = {"type": "function", "function": {"name": "f", "parameters": nested(800)}}
SURROGATE_TOOL = {"type": "function", "function": {"name": "f", "description": "\ud800"}}


@dataclass(frozen=True)
class Case:
    """One named hostile request: where it goes, its bytes, and a word the 4xx must contain."""

    name: str
    path: str
    body: bytes
    names: str  # the field (or condition) the error must name
    headers: dict[str, str] = field(default_factory=dict)


NAMED_CASES = [
    # 6. seeds outside 64 bits, also with n > 1 and streamed
    Case("seed_above_int64", CHAT, chat_with(seed=2**64), "seed"),
    Case("seed_below_int64", CHAT, chat_with(seed=-(2**63) - 1), "seed"),
    Case("seed_above_int64_n2", CHAT, chat_with(seed=2**70, n=2), "seed"),
    Case("seed_above_int64_stream", CHAT, chat_with(seed=2**64, stream=True), "seed"),
    # 7. lone surrogates, escaped and as raw bytes
    Case("surrogate_in_content", CHAT, chat_with(messages=[{"role": "user", "content": "a\ud800b"}]), "messages"),
    Case(
        "surrogate_raw_bytes", CHAT, raw({**BASE_CHAT, "messages": [{"role": "user", "content": "\ud800"}]}), "messages"
    ),
    Case("surrogate_in_tool", CHAT, chat_with(tools=[SURROGATE_TOOL]), "tools"),
    Case("surrogate_in_model", CHAT, chat_with(model="\udfff"), "model"),
    Case("surrogate_in_metadata", TRAJECTORIES, batch_with(metadata={"k": "\ud800"}), "metadata"),
    Case("surrogate_in_request_messages", TRAJECTORIES, batch_with_turn(request_messages=[{"c": "\ud800"}]), "request"),
    Case(
        "surrogate_raw_in_trajectory",
        TRAJECTORIES,
        raw({"trajectories": [{**base_batch()["trajectories"][0], "task_id": "\ud800"}]}),
        "task_id",
    ),
    # 8. depth and size bombs
    Case("json_1000_deep", CHAT, b'{"messages": ' + b"[" * 1000 + b"]" * 1000 + b"}", "nested"),
    Case(
        "json_1000_deep_trajectories", TRAJECTORIES, b'{"trajectories": ' + b"[" * 1000 + b"]" * 1000 + b"}", "nested"
    ),
    Case("int_4301_digits", CHAT, b'{"messages": [], "n": ' + b"9" * 4301 + b"}", "JSON"),
    Case("int_4301_digits_trajectory", TRAJECTORIES, b'{"trajectories": [{"reward": ' + b"1" * 5000 + b"}]}", "JSON"),
    Case("tool_schema_800_deep", CHAT, chat_with(tools=[DEEP_SCHEMA]), "tools"),
    Case("metadata_300_deep", TRAJECTORIES, batch_with(metadata=nested(300)), "metadata"),
    Case("messages_of_integers", CHAT, json.dumps({"messages": list(range(200_000))}).encode(), "messages"),
    Case("huge_n_and_max_tokens", CHAT, chat_with(n=64, max_tokens=10**9), "max_tokens"),
    Case("max_tokens_past_context", CHAT, chat_with(max_tokens=5000), "max_tokens"),
    Case("top_logprobs_bomb", CHAT, chat_with(n=64, logprobs=True, top_logprobs=20, max_tokens=1000), "n"),
    Case("long_stop_string", CHAT, chat_with(stop=["x" * 5000]), "stop"),
    Case(
        "too_many_tools",
        CHAT,
        chat_with(tools=[{"type": "function", "function": {"name": f"f{i}"}} for i in range(300)]),
        "tools",
    ),
    Case(
        "message_too_long_for_context",
        CHAT,
        chat_with(messages=[{"role": "user", "content": "word " * 200_000}]),
        "messages",
    ),
    # 9. signatures and 64-bit token ids / versions
    Case("signature_not_ascii", TRAJECTORIES, batch_with_turn(signature="é" * 32), "signature"),
    Case(
        "token_id_above_int64", TRAJECTORIES, batch_with_turn(completion_token_ids=[2**63, 1]), "completion_token_ids"
    ),
    Case("token_id_below_int64", TRAJECTORIES, batch_with_turn(prompt_token_ids=[-(2**63) - 1]), "prompt_token_ids"),
    Case("version_above_int64", TRAJECTORIES, batch_with_turn(completion_versions=[2**64, 0]), "completion_versions"),
    Case(
        "signed_big_ids",
        TRAJECTORIES,
        batch_with_turn(signature="ab" * 16, prompt_token_ids=[2**63]),
        "prompt_token_ids",
    ),
    # 10. negative versions, ids as strings
    Case("negative_versions", TRAJECTORIES, batch_with_turn(completion_versions=[-1, 0]), "completion_versions"),
    Case("negative_policy_version", TRAJECTORIES, batch_with_turn(policy_version=-3), "policy_version"),
    Case(
        "token_ids_as_strings", TRAJECTORIES, batch_with_turn(completion_token_ids=["5", "6"]), "completion_token_ids"
    ),
    Case(
        "prefix_ids_as_strings",
        CHAT,
        chat_with(agentjet={"prefix_token_ids": ["1", "2"], "prefix_prompt_tokens": 1}),
        "prefix_token_ids",
    ),
    # and the rest of the hostile-body family
    Case("nan_reward", TRAJECTORIES, batch_with(reward=float("nan")), "reward"),
    Case("not_json", CHAT, b"{'messages': []}", "JSON"),
    Case("not_utf8", CHAT, b'{"messages": "\xff\xfe"}', "JSON"),
    Case("array_body", TRAJECTORIES, b"[1, 2, 3]", "object"),
    Case("empty_body", CHAT, b"", "empty"),
    Case(
        "many_broken_trajectories",
        TRAJECTORIES,
        json.dumps({"trajectories": [{"turns": [{}] * 512}] * 1024}).encode(),
        "trajectories",
    ),
]


# -- generated cases ------------------------------------------------------------------------------------

# sampling floats down to denormals: the numeric edges a sampler divides by or cuts a distribution at
EDGE_FLOATS = st.one_of(
    st.sampled_from([5e-324, 1e-323, 2.2250738585072014e-308, 1e-300, 1e-45, 1e-38, 1e-6, 1e-5, 9.99e-6, 2.0, 1.0]),
    st.floats(min_value=0.0, max_value=2.0, allow_subnormal=True),
    st.floats(min_value=-1e-300, max_value=1e-300, allow_subnormal=True),
)
SURROGATES = st.sampled_from(["\ud800", "a\udfffb", "\udbff\udc00", "\x00", "é", "\u2028", "{{ x }}", "<|im_end|>"])
LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.integers(min_value=-3, max_value=3000),
    st.floats(allow_nan=True, allow_infinity=True),
    EDGE_FLOATS,
    st.text(max_size=16),
    SURROGATES,
)
VALUES = st.recursive(
    LEAVES,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=10,
)

CHAT_PATHS = [
    ("model",),
    ("messages",),
    ("messages", 0),
    ("messages", 0, "content"),
    ("messages", 0, "role"),
    ("messages", 0, "name"),
    ("messages", 0, "tool_calls"),
    ("max_tokens",),
    ("max_completion_tokens",),
    ("n",),
    ("seed",),
    ("stop",),
    ("temperature",),
    ("top_p",),
    ("logprobs",),
    ("top_logprobs",),
    ("tools",),
    ("tool_choice",),
    ("stream",),
    ("stream_options",),
    ("agentjet",),
    ("agentjet", "prefix_token_ids"),
    ("response_format",),
    ("metadata",),
    ("user",),
    ("unknown_field",),
]
TRAJECTORY_PATHS = [
    ("trajectories",),
    ("trajectories", 0),
    ("trajectories", 0, "id"),
    ("trajectories", 0, "task_id"),
    ("trajectories", 0, "status"),
    ("trajectories", 0, "reward"),
    ("trajectories", 0, "agent_rewards"),
    ("trajectories", 0, "metadata"),
    ("trajectories", 0, "turns"),
    ("trajectories", 0, "turns", 0, "agent"),
    ("trajectories", 0, "turns", 0, "policy_version"),
    ("trajectories", 0, "turns", 0, "request_messages"),
    ("trajectories", 0, "turns", 0, "prompt_token_ids"),
    ("trajectories", 0, "turns", 0, "completion_token_ids"),
    ("trajectories", 0, "turns", 0, "completion_logprobs"),
    ("trajectories", 0, "turns", 0, "completion_versions"),
    ("trajectories", 0, "turns", 0, "finish_reason"),
    ("trajectories", 0, "turns", 0, "signature"),
    ("trajectories", 0, "turns", 0, "reward"),
    ("trajectories", 0, "unknown_field"),
]


def _set(data: Any, path: tuple[Any, ...], value: Any) -> None:
    """Set (or, for the sentinel ``...``, delete) ``path`` in ``data`` where the containers exist."""
    target = data
    for key in path[:-1]:
        try:
            target = target[key]
        except (KeyError, IndexError, TypeError):
            return
    last = path[-1]
    if isinstance(target, dict):
        if value is ...:
            target.pop(last, None)
        else:
            target[last] = value
    elif isinstance(target, list) and isinstance(last, int) and last < len(target):
        if value is ...:
            del target[last]
        else:
            target[last] = value


@st.composite
def bodies(draw: st.DrawFn, base: dict[str, Any], paths: list[tuple[Any, ...]]) -> bytes:
    """A valid body with one to three fields replaced by arbitrary JSON (or removed), encoded
    one of several ways (escaped, raw surrogate bytes, or cut short)."""
    data = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(paths))
        _set(data, path, draw(st.one_of(VALUES, st.just(...))))
    encoding = draw(st.sampled_from(["escaped", "raw", "raw", "cut"]))
    if encoding == "escaped":
        return json.dumps(data).encode()
    encoded = raw(data)
    return encoded[: draw(st.integers(0, len(encoded)))] if encoding == "cut" else encoded


CHAT_BODIES = bodies({**BASE_CHAT, "max_tokens": 4, "seed": 1}, CHAT_PATHS)
TRAJECTORY_BODIES = bodies(base_batch(), TRAJECTORY_PATHS)


def check_answer(client: httpx2.Client, path: str, body: bytes) -> tuple[int, str]:
    """Send ``body``; return ``(status, error code or '')`` after checking the answer's shape.
    Raises AssertionError for a 5xx, a malformed error, or a stream that does not end properly;
    a dropped connection raises httpx2's error."""
    with client.stream("POST", path, content=body, headers={"content-type": "application/json"}) as response:
        text = response.read().decode("utf-8", "replace")
    status = response.status_code
    assert status < 500, f"{status} for {body[:300]!r}: {text[:500]}"
    if status >= 400:
        error = json.loads(text)["error"]
        assert isinstance(error["message"], str) and error["message"], text
        assert isinstance(error["type"], str), text
        return status, str(error.get("code") or "")
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        assert text.rstrip().endswith("data: [DONE]"), f"stream not ended with [DONE]: {text[-300:]}"
        for line in text.splitlines():
            if line.startswith("data: {") and '"error"' in line[:20]:
                error = json.loads(line[6:])["error"]
                assert error["message"] and error["type"], line
    return status, ""


# settings at the edges a sampler meets, each sent alongside ordinary requests (``alongside_ordinary``)
HOSTILE_SAMPLING: list[tuple[str, dict[str, Any]]] = [
    ("temperature", {"temperature": 5e-324}),
    ("temperature", {"temperature": 1e-300}),
    ("temperature", {"temperature": 1e-45}),
    ("temperature", {"temperature": 9.99e-6}),
    ("temperature", {"temperature": 1e-5, "top_p": 5e-324}),
    ("top_p", {"top_p": 5e-324}),
    ("top_p", {"top_p": 1e-300, "temperature": 2.0}),
    ("logit_bias", {"logit_bias": {"5": 100, "6": -100}}),
    ("logit_bias", {"logit_bias": {"5": 1e308}}),
    ("presence_penalty", {"presence_penalty": 2.0}),
    ("frequency_penalty", {"frequency_penalty": -2.0}),
    ("top_k", {"top_k": 1}),
    ("min_p", {"min_p": 1.0}),
    ("repetition_penalty", {"repetition_penalty": 1e-300}),
    ("seed", {"seed": -(2**63)}),
]


async def alongside_ordinary(url: str, model: str, ordinary: int = 32) -> list[str]:
    """Every hostile sampling setting sent at once with ``ordinary`` plain requests (so they share the
    engine's batch); what went wrong, as lines (none: every ordinary request answered 200, every hostile
    one 200 or a 4xx naming its setting)."""
    import asyncio

    plain = {"model": model, "messages": [{"role": "user", "content": "Say one."}], "max_tokens": 8}
    bodies = [("", dict(plain, temperature=1.0, seed=k)) for k in range(ordinary)]
    bodies += [(name, dict(plain, **extra)) for name, extra in HOSTILE_SAMPLING]
    async with httpx2.AsyncClient(base_url=url, timeout=120) as http:
        answers = await asyncio.gather(*(http.post(CHAT, json=body) for _, body in bodies))
    wrong = []
    for (name, body), answer in zip(bodies, answers, strict=True):
        if not name and answer.status_code != 200:
            wrong.append(f"ordinary request got {answer.status_code}: {answer.text[:300]}")
        elif name and not (answer.status_code == 200 or (400 <= answer.status_code < 500 and name in answer.text)):
            wrong.append(f"{body} got {answer.status_code}: {answer.text[:300]}")
    return wrong
