"""Helpers of the API tests: a chat answer and its extension, pushing a turn built from it, SSE events."""

from __future__ import annotations

import json

import httpx2

from agentjet_client.protocol import Trajectory, Turn

ASK = [{"role": "user", "content": "What is 2 + 3?"}]


def chat_ext(sdk, **kw):
    reply = sdk.chat.completions.create(model="agentjet-tiny", **kw)
    return reply.choices[0], reply.choices[0].model_extra["agentjet"]


def accepted(live_server, ext, tag: str) -> str:
    """Push a turn built from ``ext`` (as the client would): the server's answer for it."""
    turn = Turn(
        policy_version=ext["policy_version"],
        prompt_token_ids=ext["prompt_token_ids"],
        completion_token_ids=ext["completion_token_ids"],
        completion_logprobs=ext["completion_logprobs"],
        completion_versions=ext["completion_versions"],
        finish_reason=ext["finish_reason"],
        signature=ext["signature"],
    )
    batch = {"trajectories": [Trajectory(id=f"api-{tag}", task_id=f"api-{tag}", turns=[turn], reward=1.0).model_dump()]}
    return str(httpx2.post(live_server.url + "/v1/trajectories", json=batch).json()["results"][0]["status"])


def sse_events(response: httpx2.Response) -> list[tuple[str, dict]]:  # type: ignore[type-arg]
    events, kind = [], None
    for line in response.iter_lines():
        if line.startswith("event:"):
            kind = line[6:].strip()
        elif line.startswith("data:"):
            events.append((kind, json.loads(line[5:])))
    return events


def post(live_server, path, **kw):
    return httpx2.post(live_server.url + path, timeout=30, **kw)
