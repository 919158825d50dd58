"""The gateway in front of a real server on 127.0.0.1: every API through it, sessions and their keys,
feedback and its errors, fan-out, idle ends and expiry, a restart from the journal, the fallback."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import anthropic
import httpx2
import openai
import pytest
import uvicorn

from agentjet_client.gateway import Gateway, GatewayConfig
from agentjet_client.gateway.forward import first_choice_only, redact_body
from agentjet_server.batching.timeline import build_timelines
from tests.conftest import LiveServer, free_port

ASK = [{"role": "user", "content": "Write seven as a digit."}]


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[LiveServer]:
    live = LiveServer(model_dir, batch_groups=64, group_size=4, max_staleness=1000)
    yield live
    live.stop()


@contextmanager
def gateway(server_url: str, spool: Path, **options: object) -> Iterator[str]:
    """A gateway in a thread; yields its /v1 base URL."""
    with running_gateway(server_url, spool, **options) as (_, base):
        yield base


@contextmanager
def running_gateway(server_url: str, spool: Path, **options: object) -> Iterator[tuple[Gateway, str]]:
    """A gateway in a thread; yields it and its /v1 base URL."""
    made = Gateway(GatewayConfig(server=server_url, spool_dir=spool, sweep_s=0.1, status_s=0.5, **options))  # type: ignore[arg-type]
    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(made.app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not uv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the gateway did not start"
        time.sleep(0.02)
    try:
        yield made, f"http://127.0.0.1:{port}/v1"
    finally:
        uv.should_exit = True
        thread.join(timeout=20)


@pytest.fixture
def sdk() -> Iterator[Callable[..., Any]]:
    """Makes SDK clients that are closed when the test ends (an open pool would warn when collected later)."""
    with ExitStack() as stack:

        def make(kind: Callable[..., Any], **options: Any) -> Any:
            return stack.enter_context(kind(**options))

        yield make


def feedback(base: str, **body: object) -> httpx2.Response:
    return httpx2.post(base + "/feedback", json=body)


def pushed(server: LiveServer, trajectory_id: str, limit: float = 20) -> dict:  # type: ignore[type-arg]
    """The trajectory as the server received it (waits for the gateway's sender)."""
    deadline = time.monotonic() + limit
    while True:
        found = server.runtime.recent.get(trajectory_id)
        if found is not None:
            return found.model_dump()  # type: ignore[no-any-return]
        assert time.monotonic() < deadline, f"{trajectory_id} never reached the server"
        time.sleep(0.05)


def test_every_api_through_the_gateway_becomes_one_session_and_one_episode(server, tmp_path, sdk):
    with gateway(server.url, tmp_path) as base:
        headers = {"X-AgentJet-Session": "conv-1"}
        oa = sdk(openai.OpenAI, base_url=base, api_key="k", default_headers=headers)
        first = oa.chat.completions.create(model="m", messages=ASK, max_tokens=4)
        again = [
            *ASK,
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "Once more."},
        ]
        stream = oa.chat.completions.create(model="m", messages=again, max_tokens=4, stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        reply = oa.responses.create(model="m", input=ASK, max_output_tokens=4)
        chained = sdk(
            openai.OpenAI, base_url=base, api_key="k"
        )  # no header: the previous_response_id names the session
        follow = chained.responses.create(
            model="m", input="And eight?", previous_response_id=reply.id, max_output_tokens=4
        )
        claude = sdk(anthropic.Anthropic, base_url=base.removesuffix("/v1"), api_key="k", default_headers=headers)
        with claude.messages.stream(model="m", max_tokens=4, messages=ASK) as s:
            s.get_final_message()
        oa.completions.create(model="m", prompt="Once upon", max_tokens=4)
        view = httpx2.get(base + "/sessions/conv-1").json()
        assert view["open"] and view["calls"] == 6 and view["trainable"]
        answer = feedback(base, session="conv-1", reward=0.5, turn_rewards={"1": 1.0}, agent_rewards={"default": 0.5})
        assert answer.status_code == 200, answer.text
        result = answer.json()
        assert result["outcome"] == "trained" and len(result["trajectories"]) == 1
        trajectory = pushed(server, result["trajectories"][0])
    assert isinstance(streamed, str) and follow.id != reply.id
    turns = trajectory["turns"]
    assert len(turns) == 6 and trajectory["reward"] == 0.5 and trajectory["agent_rewards"] == {"default": 0.5}
    assert [t["reward"] for t in turns][:2] == [None, 1.0]
    assert trajectory["metadata"]["session"] == "conv-1" and trajectory["metadata"]["group_size"] == 4
    # the second chat call continues the first, the chained response the first one: fewer timelines than calls
    from agentjet_client.protocol import Turn

    assert len(build_timelines([Turn.model_validate(t) for t in turns])) < 6


def test_feedback_errors_and_repeats_say_what_is_wrong(server, tmp_path, sdk):
    with gateway(server.url, tmp_path, labels={"up": 1.0, "down": 0.0}) as base:
        oa = sdk(openai.OpenAI, base_url=base, api_key="k")
        made = oa.chat.completions.with_raw_response.create(model="m", messages=ASK, max_tokens=3, user="alice")
        session_id = made.headers["x-agentjet-session-id"]
        assert made.headers["x-agentjet-session"] == "user:alice"
        cases = [
            ({"session": "user:alice"}, 400, "reward"),
            ({"session": "user:alice", "reward": 1, "label": "up"}, 400, "not both"),
            ({"session": "user:alice", "label": "meh"}, 400, "--label meh=REWARD"),
            ({"session": "user:alice", "reward": 1, "colour": 2}, 400, "colour: unknown field"),
            ({"session": "user:alice", "reward": 1, "candidate_rewards": [1, 0]}, 400, "--fan-out"),
            ({"session": "user:alice", "reward": 1, "turn_rewards": {"3": 1}}, 400, "turn_rewards index 3"),
            ({"session": "nobody", "reward": 1}, 404, "X-AgentJet-Session"),
        ]
        for body, status, says in cases:
            answer = feedback(base, **body)
            assert answer.status_code == status and says in answer.json()["error"]["message"], (body, answer.text)
        bad = httpx2.post(base + "/feedback", content=b"{not json")
        assert bad.status_code == 400 and "invalid feedback" in bad.json()["error"]["message"]
        first = feedback(base, session=session_id, label="up").json()
        assert first["outcome"] == "trained" and first["reward"] == 1.0 and not first["repeated"]
        again = feedback(base, session="user:alice", reward=1.0)
        assert (
            again.status_code == 200
            and again.json()["repeated"]
            and again.json()["trajectories"] == first["trajectories"]
        )
        other = feedback(base, session=session_id, reward=0.0)
        assert other.status_code == 409 and "already ended with reward 1" in other.json()["error"]["message"]
        status = httpx2.get(base + "/gateway/status").json()
    assert status["counts"]["trained"] == 1 and status["counts"]["sessions"] == 1


def test_fan_out_returns_one_answer_and_pushes_the_group_with_its_rewards(server, tmp_path, sdk):
    with gateway(server.url, tmp_path, fan_out=4) as base:
        oa = sdk(openai.OpenAI, base_url=base, api_key="k", default_headers={"X-AgentJet-Session": "fan"})
        reply = oa.chat.completions.create(model="m", messages=ASK, max_tokens=4)
        assert len(reply.choices) == 1 and reply.choices[0].index == 0
        view = httpx2.get(base + "/sessions/fan").json()
        assert (
            len(view["candidates"]) == 4 and view["candidates"][0] == (reply.choices[0].message.content or "").strip()
        )
        streamed = sdk(openai.OpenAI, base_url=base, api_key="k", default_headers={"X-AgentJet-Session": "fan-stream"})
        chunks = list(streamed.chat.completions.create(model="m", messages=ASK, max_tokens=4, stream=True))
        assert {c.index for chunk in chunks for c in chunk.choices} == {0}
        result = feedback(base, session="fan", reward=1.0, candidate_rewards=[1.0, 0.0, 0.5, 0.0]).json()
        only_shown = feedback(base, session="fan-stream", reward=1.0).json()
        # a fan-out session that goes on past its first call trains the path the user saw
        longer = sdk(openai.OpenAI, base_url=base, api_key="k", default_headers={"X-AgentJet-Session": "fan-long"})
        first = longer.chat.completions.create(model="m", messages=ASK, max_tokens=4)
        more = [
            *ASK,
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "Again."},
        ]
        longer.chat.completions.create(model="m", messages=more, max_tokens=4)
        path = feedback(base, session="fan-long", reward=0.0).json()
        status = httpx2.get(base + "/gateway/status").json()
        group = [pushed(server, t) for t in result["trajectories"]]
        kept = pushed(server, path["trajectories"][0])
    assert len(group) == 4 and len({t["task_id"] for t in group}) == 1
    assert [t["reward"] for t in group] == [1.0, 0.0, 0.5, 0.0]
    assert all(len(t["turns"]) == 1 and t["metadata"]["group_size"] == 4 for t in group)
    shown = group[0]["turns"][0]["completion_token_ids"]
    assert [t["metadata"]["candidate"] for t in group] == [0, 1, 2, 3] and shown
    assert len(only_shown["trajectories"]) == 1  # no candidate rewards: the other three are dropped
    assert len(kept["turns"]) == 2
    assert status["counts"]["candidates_dropped"] == 3 + 3


def test_idle_sessions_end_and_unrewarded_ones_expire(server, tmp_path, sdk):
    with gateway(server.url, tmp_path, idle_s=0.4, ttl_s=1.2) as base:
        oa = sdk(openai.OpenAI, base_url=base, api_key="k", default_headers={"X-AgentJet-Session": "slow"})
        first = oa.chat.completions.with_raw_response.create(model="m", messages=ASK, max_tokens=3)
        time.sleep(0.8)  # idle: the next call with the same key opens a new session
        second = oa.chat.completions.with_raw_response.create(model="m", messages=ASK, max_tokens=3)
        assert first.headers["x-agentjet-session-id"] != second.headers["x-agentjet-session-id"]
        closed = httpx2.post(base + f"/sessions/{second.headers['x-agentjet-session-id']}/close")
        assert closed.status_code == 200 and closed.json()["ended"]
        third = oa.chat.completions.with_raw_response.create(model="m", messages=ASK, max_tokens=3)
        assert third.headers["x-agentjet-session-id"] not in (first.headers["x-agentjet-session-id"],)
        time.sleep(1.6)
        late = feedback(base, session=first.headers["x-agentjet-session-id"], reward=1.0)
        counts = httpx2.get(base + "/gateway/status").json()["counts"]
    assert late.status_code == 410 and "expired" in late.json()["error"]["message"]
    assert counts["expired"] == 3 and counts["open"] == counts["waiting"] == 0 and counts["sessions"] == 3


def test_a_restarted_gateway_goes_on_with_its_open_sessions(server, tmp_path, sdk):
    with gateway(server.url, tmp_path) as base:
        oa = sdk(openai.OpenAI, base_url=base, api_key="k", default_headers={"X-AgentJet-Session": "long"})
        first = oa.chat.completions.create(model="m", messages=ASK, max_tokens=4)
    with gateway(server.url, tmp_path) as base:
        oa = sdk(openai.OpenAI, base_url=base, api_key="k", default_headers={"X-AgentJet-Session": "long"})
        more = [
            *ASK,
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "Again."},
        ]
        oa.chat.completions.create(model="m", messages=more, max_tokens=4)
        result = feedback(base, session="long", reward=1.0).json()
        trajectory = pushed(server, result["trajectories"][0])
    from agentjet_client.protocol import Turn

    turns = [Turn.model_validate(t) for t in trajectory["turns"]]
    assert len(turns) == 2 and len(build_timelines(turns)) == 1  # the restored turn still continues


def test_calls_answered_together_are_journaled_together_and_a_restart_reads_every_one_back(server, tmp_path):
    async def burst(base: str) -> None:
        async with openai.AsyncOpenAI(base_url=base, api_key="k") as oa:
            await asyncio.gather(
                *[
                    oa.chat.completions.create(
                        model="m", messages=ASK, max_tokens=4, extra_headers={"X-AgentJet-Session": key}
                    )
                    for key in ["burst"] * 8 + [f"single-{k}" for k in range(8)]
                ]
            )

    with running_gateway(server.url, tmp_path) as (made, base):
        asyncio.run(burst(base))
        commits = made.book._notes.commits
        counts = made.journal.counts()
    assert counts["sessions"] == 9 and counts["calls"] == 16
    assert commits < 16  # some calls answered together shared a transaction
    with gateway(server.url, tmp_path) as base:
        result = feedback(base, session="burst", reward=1.0).json()
        trajectory = pushed(server, result["trajectories"][0])
    assert len(trajectory["turns"]) == 8  # every call of the session, read back from the journal


def test_opted_out_calls_are_recorded_nowhere(server, tmp_path, sdk):
    with gateway(server.url, tmp_path, opt_in=True) as base:
        oa = sdk(openai.OpenAI, base_url=base, api_key="k", default_headers={"X-AgentJet-Session": "private"})
        oa.chat.completions.create(model="m", messages=ASK, max_tokens=3)
        missing = feedback(base, session="private", reward=1.0)
        yes = sdk(
            openai.OpenAI,
            base_url=base,
            api_key="k",
            default_headers={"X-AgentJet-Session": "ok", "X-AgentJet-Train": "yes"},
        )
        yes.chat.completions.create(model="m", messages=ASK, max_tokens=3)
        counts = httpx2.get(base + "/gateway/status").json()["counts"]
    assert missing.status_code == 404
    assert counts["untrained_calls"] == 1 and counts["sessions"] == 1 and counts["open"] == 1


def test_without_the_server_it_answers_503_or_from_the_fallback(server, tmp_path, sdk):
    dead = f"http://127.0.0.1:{free_port()}"
    with gateway(dead, tmp_path / "a") as base:
        reply = httpx2.post(base + "/chat/completions", json={"model": "m", "messages": ASK, "max_tokens": 3})
    assert reply.status_code == 503 and reply.headers["retry-after"] == "5"
    assert "--fallback URL" in reply.json()["error"]["message"] and dead in reply.json()["error"]["message"]
    with gateway(dead, tmp_path / "b", fallback=server.url + "/v1") as base:
        oa = sdk(openai.OpenAI, base_url=base, api_key="k", default_headers={"X-AgentJet-Session": "fb"})
        answered = oa.chat.completions.create(model="agentjet-tiny", messages=ASK, max_tokens=3)  # as served there
        view = httpx2.get(base + "/sessions/fb").json()
        result = feedback(base, session="fb", reward=1.0).json()
        counts = httpx2.get(base + "/gateway/status").json()["counts"]
    assert answered.choices and not view["trainable"]
    assert result["outcome"] == "fallback" and result["trajectories"] == [] and counts["fallback"] == 1


def wait_outcome(base: str, session: str, limit: float = 20) -> dict:  # type: ignore[type-arg]
    """The session's view once it has ended one way or another (a judge works in the background)."""
    deadline = time.monotonic() + limit
    while "outcome" not in (view := httpx2.get(base + f"/sessions/{session}").json()):
        assert time.monotonic() < deadline, f"session {session} still unfinished: {view}"
        time.sleep(0.05)
    return view  # type: ignore[no-any-return]


def digit_score(answer: str) -> float:
    """The rules judge's ``digits`` rule for "Write seven as a digit."."""
    answer = answer.strip()
    return 1.0 if answer == "7" else 0.2 if len(answer) == 1 and answer.isdigit() else 0.0


def test_a_judge_rewards_the_sessions_without_feedback(server, tmp_path, sdk):
    from agentjet_client.tasks.judges import Judge
    from tests.conftest import RulesJudge

    rules = RulesJudge("digits")
    try:
        judge = Judge(rules.url, "rules", "The digit the user asked for.", retries=0)
        with gateway(server.url, tmp_path / "a", judge=judge, judge_after_s=0.3, idle_s=0.5) as base:
            oa = sdk(openai.OpenAI, base_url=base, api_key="k")
            one = oa.chat.completions.with_raw_response.create(
                model="m", messages=ASK, max_tokens=3, extra_headers={"X-AgentJet-Session": "quiet"}
            )
            httpx2.post(base + "/sessions/quiet/close")
            told = oa.chat.completions.create(
                model="m", messages=ASK, max_tokens=3, extra_headers={"X-AgentJet-Session": "told"}
            )
            given = feedback(base, session="told", reward=0.7).json()  # feedback first: never judged
            first = oa.chat.completions.create(
                model="m", messages=ASK, max_tokens=3, extra_headers={"X-AgentJet-Session": "long"}
            )
            more = [
                *ASK,
                {"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "Again."},
            ]
            last = oa.chat.completions.create(
                model="m", messages=more, max_tokens=3, extra_headers={"X-AgentJet-Session": "long"}
            )  # then idle: it ends by --idle and is judged by its final answer
            quiet, long = wait_outcome(base, "quiet"), wait_outcome(base, "long")
            late = feedback(base, session="quiet", reward=quiet["reward"] + 0.5)
            counts = httpx2.get(base + "/gateway/status").json()["counts"]
            calls = rules.calls()
        answer = one.parse().choices[0].message.content or ""
        assert quiet["outcome"] == "trained" and quiet["reward"] == digit_score(answer)
        assert long["reward"] == digit_score(last.choices[0].message.content or "")
        assert given["outcome"] == "trained" and given["reward"] == 0.7 and told.choices
        assert late.status_code == 409 and "judge" in late.json()["error"]["message"]
        assert counts["judged"] == 2 and counts["trained"] == 3 and calls == 2
        assert pushed(server, quiet["trajectories"][0])["reward"] == quiet["reward"]
        assert len(pushed(server, long["trajectories"][0])["turns"]) == 2
    finally:
        rules.stop()


def test_a_judge_scores_fan_out_candidates_side_by_side_and_a_failing_judge_leaves_the_ttl(server, tmp_path, sdk):
    from agentjet_client.tasks.judges import Judge
    from tests.conftest import RulesJudge

    rules = RulesJudge("digits")
    try:
        judge = Judge(rules.url, "rules", "The digit the user asked for.", retries=0)
        with gateway(server.url, tmp_path / "a", judge=judge, judge_after_s=0.0, fan_out=4) as base:
            oa = sdk(openai.OpenAI, base_url=base, api_key="k", default_headers={"X-AgentJet-Session": "fan"})
            oa.chat.completions.create(model="m", messages=ASK, max_tokens=3)
            candidates = httpx2.get(base + "/sessions/fan").json()["candidates"]
            httpx2.post(base + "/sessions/fan/close")
            view = wait_outcome(base, "fan")
            group = [pushed(server, t) for t in view["trajectories"]]
    finally:
        rules.stop()
    assert [t["reward"] for t in group] == [digit_score(c) for c in candidates]
    assert len({t["task_id"] for t in group}) == 1 and len(group) == 4
    down = Judge(f"http://127.0.0.1:{free_port()}/v1", "rules", "anything", retries=0, timeout=2)
    with gateway(server.url, tmp_path / "b", judge=down, judge_after_s=0.0, idle_s=0.2, ttl_s=1.0) as base:
        oa = sdk(openai.OpenAI, base_url=base, api_key="k", default_headers={"X-AgentJet-Session": "unjudged"})
        oa.chat.completions.create(model="m", messages=ASK, max_tokens=3)
        view = wait_outcome(base, "unjudged")
        counts = httpx2.get(base + "/gateway/status").json()["counts"]
    assert view["outcome"] == "expired" and counts["expired"] == 1 and counts["judged"] == 0


def test_redaction_reaches_every_text_field_and_first_choice_only_filters_streams():
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "mail bob@x.org"}]}],
        "system": "bob@x.org",
        "input": [{"type": "message", "role": "user", "content": "bob@x.org"}],
        "user": "bob@x.org",
    }
    out, changed = redact_body(body, lambda s: s.replace("bob@x.org", "[email]"))
    assert changed and "bob@x.org" not in str({k: v for k, v in out.items() if k != "user"})
    assert out["user"] == "bob@x.org" and out["messages"][0]["role"] == "user"
    event = b'data: {"choices": [{"index": 1, "delta": {"content": "a"}}]}\n\n'
    assert first_choice_only(event) is None
    assert first_choice_only(b"data: [DONE]\n\n") == b"data: [DONE]\n\n"
    both = b'data: {"choices": [{"index": 0, "delta": {}}, {"index": 2, "delta": {}}]}\n\n'
    assert b'"index": 2' not in (first_choice_only(both) or b"")
