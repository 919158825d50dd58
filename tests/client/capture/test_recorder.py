"""Capture through both front doors (SDK transport, loopback proxy) against a real server."""

import asyncio
import json

import httpx2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentjet_client import SwarmClient
from agentjet_client.capture.recorder import SSECollector

ASK = [{"role": "user", "content": "Write two as a digit."}]


@pytest.fixture()
def client(live_server):
    with SwarmClient(live_server.url) as c:
        yield c


def test_sync_openai_capture_records_exact_turns(client):
    episode = client.episode("task-a")
    llm = episode.openai(agent="solver")
    reply = llm.chat.completions.create(model="agentjet-tiny", messages=ASK, max_tokens=4)
    episode.close()
    traj = episode.to_trajectory(1.0)
    assert traj.status == "complete" and len(traj.turns) == 1
    turn = traj.turns[0]
    ext = reply.choices[0].model_extra["agentjet"]
    assert turn.agent == "solver" and turn.completion_token_ids == ext["completion_token_ids"]
    assert turn.request_messages == ASK
    assert client.submit([traj]).results[0].status == "accepted"


@pytest.mark.parametrize("n", [1, 3])
def test_async_streaming_capture_equals_non_streaming(client, n):
    """Same seed, streamed or not: the same turns (one per choice), field for field but timings and
    the signature (whose nonce is new for each sampling; each is checked where it is pushed)."""

    async def run(stream):
        episode = client.episode("task-b")
        llm = episode.async_openai()
        kw = dict(model="agentjet-tiny", messages=ASK, max_tokens=6, temperature=1.0, seed=11, n=n)
        if stream:
            async for _ in await llm.chat.completions.create(stream=True, **kw):
                pass
        else:
            await llm.chat.completions.create(**kw)
        await episode.aclose()
        await client.aclose_pool()
        turns = episode.recorder.turns
        assert all(t.signature for t in turns)
        return [t.model_dump(exclude={"started_at", "latency_s", "signature"}) for t in turns]

    streamed, whole = asyncio.run(run(True)), asyncio.run(run(False))
    assert len(streamed) == len(whole) == n
    assert streamed == whole
    if n > 1:  # the choices really are separate samples, each recorded
        assert len({tuple(t["completion_token_ids"]) for t in whole}) > 1


def test_proxy_captures_raw_http_and_streams(client):
    episode = client.episode("task-c")
    base = episode.url_for("critic")
    r = httpx2.post(base + "/chat/completions", json={"messages": ASK, "max_tokens": 4})
    assert r.status_code == 200
    with httpx2.stream(
        "POST", base + "/chat/completions", json={"messages": ASK, "max_tokens": 4, "stream": True}
    ) as s:
        body = "".join(s.iter_text())
    assert "data: [DONE]" in body
    assert httpx2.get(base + "/models").json()["data"][0]["id"] == "agentjet-tiny"
    turns = episode.recorder.turns
    assert [t.agent for t in turns] == ["critic", "critic"] and episode.recorder.failures == 0
    r = httpx2.post(base + "/chat/completions", json={"messages": [{"role": "robot"}]})
    assert r.status_code == 400 and len(episode.recorder.turns) == 2  # errors pass through, nothing recorded
    episode.close()
    r = httpx2.post(base + "/chat/completions", json={"messages": ASK})
    assert r.status_code == 404 and "not open" in r.json()["error"]["message"]


def test_capture_failure_never_reaches_the_agent():
    """A response without our extension (a plain OpenAI server) is counted, not raised."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def plain(request):
        return JSONResponse(
            {
                "id": "x",
                "object": "chat.completion",
                "created": 0,
                "model": "m",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
            }
        )

    app = Starlette(routes=[Route("/v1/chat/completions", plain, methods=["POST"])])
    with SwarmClient("http://plain.test", async_transport_factory=lambda: httpx2.ASGITransport(app=app)) as c:
        episode = c.episode("t")

        async def go():
            try:
                return await episode.async_openai().chat.completions.create(model="m", messages=ASK)
            finally:
                await c.aclose_pool()

        reply = asyncio.run(go())
        assert reply.choices[0].message.content == "hi"
        assert episode.recorder.failures == 1 and "agentjet" in episode.recorder.last_failure
        traj = episode.to_trajectory(0.0)
        assert traj.status == "failed" and traj.metadata["capture_failures"] == 1


def test_malformed_upstream_answers_through_the_proxy_are_counted_not_raised():
    """Raw HTTP through the capture proxy: a body that is not JSON, and one whose extension is
    broken, reach the agent exactly as sent; the capture counts two failures."""
    import threading
    import time

    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    from tests.conftest import free_port

    answers = iter(
        [
            Response("not json {", media_type="application/json"),
            JSONResponse(
                {
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": "hi"},
                            "finish_reason": "stop",
                            "agentjet": {"prompt_token_ids": [1], "completion_token_ids": [2, 3]},
                        }
                    ]
                }
            ),
        ]
    )

    async def broken(request):
        return next(answers)

    port = free_port()
    app = Starlette(routes=[Route("/v1/chat/completions", broken, methods=["POST"])])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        with SwarmClient(f"http://127.0.0.1:{port}") as c:
            episode = c.episode("t")
            url = episode.base_url + "/chat/completions"
            first = httpx2.post(url, json={"messages": ASK})
            second = httpx2.post(url, json={"messages": ASK})
            assert first.status_code == 200 and first.text == "not json {"
            assert second.status_code == 200 and second.json()["choices"][0]["message"]["content"] == "hi"
            assert episode.recorder.failures == 2 and episode.recorder.turns == []
            episode.close()
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.mark.parametrize("stream", [False, True])
def test_a_repeated_call_is_continued_from_the_answer_that_came_back(client, stream):
    """Two calls with the same messages (a framework asking again): the next request continues
    the one whose answer it sends back, here the older one, in content blocks as AgentScope sends it."""
    episode = client.episode("task-retry")
    llm = episode.openai()
    kw = dict(model="agentjet-tiny", messages=ASK, max_tokens=6, temperature=1.0)
    answers: dict[str, int] = {}  # answer text -> index of its turn
    for seed in range(40):
        if stream:
            chunks = llm.chat.completions.create(**kw, seed=seed, stream=True)
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
        else:
            text = llm.chat.completions.create(**kw, seed=seed).choices[0].message.content or ""
        if text.strip() and text.strip() not in answers:
            answers[text.strip()] = len(episode.recorder.turns) - 1
        if len(answers) == 2:
            break
    assert len(answers) == 2
    (older, index), _newer = answers.items()
    blocks = [{"type": "text", "text": older}]
    follow = [*ASK, {"role": "assistant", "content": blocks}, {"role": "user", "content": "Again."}]
    reply = llm.chat.completions.create(model="agentjet-tiny", messages=follow, max_tokens=4)
    episode.close()
    assert reply.choices[0].model_extra["agentjet"]["prefix"] in ("extended", "spliced")
    turns = episode.recorder.turns
    sampled = [*turns[index].prompt_token_ids, *turns[index].completion_token_ids]
    assert turns[-1].prompt_token_ids[: len(sampled)] == sampled


def test_turn_rewards_land_on_the_newest_call_in_process_and_through_the_proxy(client):
    """``episode.reward_turn``: in the runner's process, and from a worker process's episode (the
    capture proxy's ``turn_reward`` route); the server accepts the turns' rewards with the trajectory."""
    from agentjet_client.run.isolation import ProxyEpisode

    episode = client.episode("task-rewards")
    with pytest.raises(ValueError, match="no LLM call"):
        episode.reward_turn(1.0)
    episode.openai(agent="a").chat.completions.create(model="agentjet-tiny", messages=ASK, max_tokens=2)
    episode.openai(agent="b").chat.completions.create(model="agentjet-tiny", messages=ASK, max_tokens=2)
    episode.reward_turn(0.5)  # the newest call: agent b's
    episode.reward_turn(0.25, agent="a")
    episode.reward_turn(0.25, agent="a")  # rewards of one turn add up
    with pytest.raises(ValueError, match="finite number"):
        episode.reward_turn(float("nan"))
    worker_side = ProxyEpisode(episode.id, episode.task_id, episode.url_for("a").split("/episodes/")[0], "k")
    worker_side.openai(agent="c").chat.completions.create(model="agentjet-tiny", messages=ASK, max_tokens=2)
    worker_side.reward_turn(-1.0)
    with pytest.raises(ValueError, match="of agent 'nobody'"):
        worker_side.reward_turn(1.0, agent="nobody")
    episode.close()
    traj = episode.to_trajectory(1.0)
    assert [(t.agent, t.reward) for t in traj.turns] == [("a", 0.5), ("b", 0.5), ("c", -1.0)]
    assert client.submit([traj]).results[0].status == "accepted"
    from agentjet_client.run import isolation

    isolation._shared_http().close()  # the worker-side pool, here in the test's own process
    isolation._HTTP = None


def test_a_call_that_lists_other_tools_claims_no_earlier_call(client, live_server):
    """The tools are rendered before the messages: a request that lists other tools, or none, or
    hides them with ``tool_choice`` "none" (as AgentScope asks for its last reply) cannot begin
    with the earlier call's prompt, so no earlier call is claimed and the server's mismatch count
    stays where it was; with the same tools the request continues the sampled tokens."""
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]
    episode = client.episode("task-tools")
    llm = episode.openai()
    first = llm.chat.completions.create(model="agentjet-tiny", messages=ASK, tools=tools, max_tokens=4, seed=1)
    answer = first.choices[0].message.content or ""
    follow = [*ASK, {"role": "assistant", "content": answer}, {"role": "user", "content": "Again."}]
    before = httpx2.get(live_server.url + "/v1/status").json()["context"]
    same = llm.chat.completions.create(model="agentjet-tiny", messages=follow, tools=tools, max_tokens=4)
    other = llm.chat.completions.create(model="agentjet-tiny", messages=follow, max_tokens=4)
    hidden = llm.chat.completions.create(
        model="agentjet-tiny", messages=follow, tools=tools, tool_choice="none", max_tokens=4
    )
    episode.close()
    after = httpx2.get(live_server.url + "/v1/status").json()["context"]
    assert same.choices[0].model_extra["agentjet"]["prefix"] in ("extended", "spliced")
    assert other.choices[0].model_extra["agentjet"].get("prefix") is None
    assert hidden.choices[0].model_extra["agentjet"].get("prefix") is None
    assert after["mismatch"] == before["mismatch"] and after["prefix_requests"] == before["prefix_requests"] + 1
    turns = episode.recorder.turns
    sampled = [*turns[0].prompt_token_ids, *turns[0].completion_token_ids]
    assert turns[1].prompt_token_ids[: len(sampled)] == sampled
    assert turns[2].prompt_token_ids[: len(turns[0].prompt_token_ids)] != turns[0].prompt_token_ids


EVENTS = [{"id": 1, "text": "a\nb"}, {"id": 2, "choices": [{"index": 0}]}, {"id": 3}]


@settings(max_examples=200, deadline=None)
@given(
    line_end=st.sampled_from([b"\n", b"\r\n", b"\r"]),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=12),
    split_data=st.booleans(),
    final_blank=st.booleans(),
)
def test_sse_events_are_read_as_the_spec_reads_them_however_the_bytes_arrive(line_end, cuts, split_data, final_blank):
    """Lines end in LF, CRLF or CR (a CR at a read's end may be half a CRLF); an event's data lines join with
    newlines (a JSON object split over several); comments and other fields are skipped; [DONE] is no event."""
    body = b""
    for event in EVENTS:
        text = json.dumps(event, indent=1 if split_data else None).encode()
        body += b": a comment" + line_end + b"event: chunk" + line_end
        body += b"".join(
            b"data:" + (b" " if i % 2 else b"") + part + line_end for i, part in enumerate(text.split(b"\n"))
        )
        body += line_end
    body += b"data: [DONE]" + line_end + (line_end if final_blank else b"")
    collector = SSECollector()
    start = 0
    for cut in sorted(set(cut for cut in cuts if cut < len(body))):
        collector.feed(body[start:cut])
        start = cut
    collector.feed(body[start:])
    assert collector.chunks == EVENTS and not collector.broken
    last = SSECollector()  # a stream that ends without the blank line after its last event
    last.feed(b'data: {"id": 9}')
    assert last.chunks == [{"id": 9}]
