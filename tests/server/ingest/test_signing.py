"""Sample signatures: a pushed turn is trained only if it is exactly what this server sampled."""

from __future__ import annotations

from dataclasses import replace

import httpx2
import pytest

from agentjet_client import SwarmClient
from agentjet_client.protocol import Trajectory
from agentjet_server.ingest.signing import Sample, SampleSigner
from tests.conftest import LiveServer

ASK = [{"role": "user", "content": "Write two as a digit."}]


def sampled(url: str, n: int = 1) -> Trajectory:
    with SwarmClient(url) as client:
        episode = client.episode("task-sign")
        llm = episode.openai()
        for _ in range(n):
            llm.chat.completions.create(model="agentjet-tiny", messages=ASK, max_tokens=6, temperature=1.0)
        episode.close()
        return episode.to_trajectory(1.0)


def push(url: str, trajectory: Trajectory) -> dict:  # type: ignore[type-arg]
    body = {"trajectories": [trajectory.model_dump(mode="json")]}
    return httpx2.post(url + "/v1/trajectories", json=body).json()["results"][0]


def counts(url: str) -> dict:  # type: ignore[type-arg]
    return httpx2.get(url + "/v1/status").json()["trajectories"]


def test_signature_is_stable_and_covers_every_field():
    signer = SampleSigner.random()
    base = Sample([1, 2, 3], [4, 5], [-0.5, -0.25], [0, 0], "stop", "solver")
    sig = signer.sign(base)
    assert signer.verify(sig, base) and len(sig) == 48
    again = signer.sign(base)  # the same tokens sampled twice: two samples, two signatures
    assert again != sig and signer.verify(again, base)
    assert not signer.verify(sig[:16] + again[16:], base)  # a nonce belongs to its mac
    changed = [
        replace(base, prompt_ids=[1, 2, 4]),  # a prompt token
        replace(base, completion_ids=[4, 6]),  # a sampled token
        replace(base, logprobs=[-0.5, -0.2500001]),  # a log-prob, by a hair
        replace(base, versions=[0, 1]),  # a version
        Sample([1, 2], [3, 4, 5], [-0.5, -0.25, -0.1], [0, 0, 0], "stop", "solver"),  # the prompt/completion split
        replace(base, finish_reason="length"),
        replace(base, agent="checker"),  # the per-agent reward goes by it
        replace(base, finish_reason="stopsolver", agent=""),  # the text split
        replace(base, processed=True),  # whose distribution the log-probs are
    ]
    assert not any(signer.verify(sig, sample) for sample in changed)
    assert not SampleSigner.random().verify(sig, base)  # another server's key
    assert not signer.verify("\u00e9" * 48, base) and not signer.verify(sig.upper(), base)  # not hex: False, no error


def test_a_processed_sample_is_signed_as_processed_and_trained_as_sampled(live_server):
    """A request with a logit bias and a penalty: the turn says ``sampled_from: processed`` and carries the
    processed distribution's log-probs (the model's are in ``logprobs``); pushed as captured it verifies,
    with its mark taken off it does not."""
    with SwarmClient(live_server.url) as client:
        episode = client.episode("task-processed")
        reply = episode.openai().chat.completions.create(
            model="agentjet-tiny",
            messages=ASK,
            max_tokens=6,
            logprobs=True,
            logit_bias={"20": 6, "23": -4},
            presence_penalty=1.0,
            extra_body={"top_k": 40, "min_tokens": 2},
        )
        episode.close()
        trajectory = episode.to_trajectory(1.0)
    [turn] = trajectory.turns
    model = [entry.logprob for entry in reply.choices[0].logprobs.content]
    assert turn.sampled_from == "processed" and len(turn.completion_token_ids) >= 2
    assert turn.completion_logprobs != model  # the behaviour policy's, not the model's
    before = counts(live_server.url)
    tampered = trajectory.model_copy(
        update={"id": "tampered", "turns": [turn.model_copy(update={"sampled_from": None})]}
    )
    assert push(live_server.url, tampered)["status"] == "rejected"
    assert push(live_server.url, trajectory)["status"] == "accepted"
    assert counts(live_server.url)["verified_turns"] == before["verified_turns"] + 1


def test_pushed_turns_are_checked_against_what_was_sampled(live_server):
    url = live_server.url
    before = counts(url)
    good = sampled(url, n=2)
    assert all(turn.signature for turn in good.turns)
    assert push(url, good)["status"] == "accepted"
    after = counts(url)
    assert after["verified_turns"] - before["verified_turns"] == 2

    tampered = sampled(url)
    turn = tampered.turns[0]
    ids = list(turn.completion_token_ids)
    ids[0] = (ids[0] + 1) % 50  # still a valid token id: only the signature can tell
    tampered = tampered.model_copy(update={"turns": [turn.model_copy(update={"completion_token_ids": ids})]})
    result = push(url, tampered)
    assert result["status"] == "rejected" and "not what this server sampled" in result["reason"]

    relogged = sampled(url)
    turn = relogged.turns[0]
    logprobs = [lp - 0.01 for lp in turn.completion_logprobs]
    relogged = relogged.model_copy(update={"turns": [turn.model_copy(update={"completion_logprobs": logprobs})]})
    assert push(url, relogged)["status"] == "rejected"
    assert counts(url)["rejected_by_reason"]["not_sampled"] >= 2

    unsigned = sampled(url)  # built by code that does not copy signatures: trained, counted as unsigned
    unsigned = unsigned.model_copy(update={"turns": [t.model_copy(update={"signature": None}) for t in unsigned.turns]})
    assert push(url, unsigned)["status"] == "accepted"
    assert counts(url)["unsigned_turns"] - after["unsigned_turns"] == 1


def test_streamed_answers_are_signed_like_plain_ones(live_server):
    with SwarmClient(live_server.url) as client:
        episode = client.episode("task-sign-stream")
        llm = episode.openai()
        args = {"model": "agentjet-tiny", "messages": ASK, "max_tokens": 6, "temperature": 1.0, "seed": 7}
        llm.chat.completions.create(**args)
        for _ in llm.chat.completions.create(**args, stream=True):
            pass
        episode.close()
        plain, streamed = episode.to_trajectory(1.0).turns
    assert plain.completion_token_ids == streamed.completion_token_ids
    signer = live_server.runtime.signer  # both signed as what they are (two samplings: two nonces)
    assert signer.verify_turn(plain) and signer.verify_turn(streamed) and plain.signature != streamed.signature


@pytest.mark.parametrize("resume", [True, False])
def test_a_resumed_server_still_verifies_what_it_sampled_before(model_dir, tmp_path, resume):
    first = LiveServer(model_dir, state_dir=tmp_path)
    try:
        trajectory = sampled(first.url)
        assert push(first.url, sampled(first.url))["status"] == "accepted"  # something to resume
    finally:
        first.stop()
    second = LiveServer(model_dir, state_dir=tmp_path, resume=resume, fresh=not resume)
    try:
        result = push(second.url, trajectory)
    finally:
        second.stop()
    # --fresh discards the run and its key: its samples are no longer this server's
    assert result["status"] == ("accepted" if resume else "rejected"), result


def test_a_server_that_died_before_any_push_keeps_its_key(model_dir, tmp_path):
    """Nothing was logged, so the restart is a fresh start, but what clients sampled still verifies."""
    first = LiveServer(model_dir, state_dir=tmp_path)
    try:
        trajectory = sampled(first.url)  # sampled, spooled by the client, never pushed
    finally:
        first.stop()
    second = LiveServer(model_dir, state_dir=tmp_path, resume=True)
    try:
        assert push(second.url, trajectory)["status"] == "accepted"
    finally:
        second.stop()
