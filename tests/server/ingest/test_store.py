"""The trajectory store (``ingest.store``): each pushed trajectory is answered accepted, duplicate or rejected
with its reason; the answers are on disk before they are given, only accepted training episodes reach the
buffer (in log order), and the seen ids and counts come back from the log after a restart."""

from __future__ import annotations

import threading

import pytest

from agentjet_client.protocol import Trajectory
from agentjet_server.errors import RateLimitError
from agentjet_server.ingest.signing import Sample, SampleSigner
from agentjet_server.ingest.store import TrajectoryStore
from agentjet_server.ingest.wal import Configured, Evaluated, Published, Rejected, read_records
from tests.server.ingest.trajectories import store, traj


class Buffer:
    """What the store hands on: accepted trajectories with their log sequence numbers, absent siblings."""

    def __init__(self) -> None:
        self.added: list[tuple[str, int]] = []
        self.absent: list[str] = []

    def store(self, max_staleness: int = 2, **kw) -> TrajectoryStore:  # type: ignore[no-untyped-def]
        return TrajectoryStore(
            100, max_staleness, lambda t, lsn: self.added.append((t.id, lsn)), absent=self.absent.append, **kw
        )


def signed(signer: SampleSigner, i: int, *, versions: list[int] | None = None) -> Trajectory:
    turn = traj(i).turns[0]
    if versions is not None:
        turn = turn.model_copy(
            update={
                "completion_token_ids": [5] * len(versions),
                "completion_versions": versions,
                "completion_logprobs": [-1.0] * len(versions),
            }
        )
    turn = turn.model_copy(update={"signature": signer.sign(Sample.of(turn))})
    return traj(i).model_copy(update={"turns": [turn]})


def test_staleness_is_measured_from_the_oldest_token_and_bounded_inclusively():
    buffer = Buffer()
    s = buffer.store(max_staleness=2)
    signer = SampleSigner.random()  # versions per token, as a server that updated mid-answer records them
    at_bound, past = traj(0, version=3), traj(1, version=2)
    mixed = signed(signer, 2, versions=[2, 3, 4]).model_copy(update={"id": "t2"})
    results = s.admit_batch([at_bound, past, mixed], version=5)
    assert [r.status for r in results] == ["accepted", "rejected", "rejected"]
    assert results[1].reason == (
        "stale: its oldest turn was sampled at policy version 2, the server is at 5 and max_staleness is 2; "
        "start fewer episodes ahead of training (see admission_budget in /v1/status)"
    )
    assert "policy version 2" in (results[2].reason or "")  # its first token is what counts
    assert dict(s.rejected) == {"stale": 2} and buffer.added == [("t0", 0)]
    assert buffer.absent == ["task0", "task1"]  # their groups need not wait for them


def test_a_trajectory_that_does_not_fit_the_model_is_rejected_with_what_to_send():
    buffer = Buffer()
    s = buffer.store()
    future, foreign = traj(0, version=4), traj(1, version=3, token=100)  # vocabulary: 0..99
    results = s.admit_batch([future, foreign], version=3)
    assert [r.status for r in results] == ["rejected", "rejected"]
    assert results[0].reason == (
        "a turn claims policy version 4 but the server is at 3; send versions exactly as the server returned them"
    )
    assert results[1].reason is not None and results[1].reason.startswith(
        "turn 0 has token id 100 but the model's vocabulary has 100 tokens"
    )
    assert dict(s.rejected) == {"future_version": 1, "invalid_tokens": 1} and buffer.added == []


def test_an_id_is_answered_once_whatever_came_of_it():
    buffer = Buffer()
    s = buffer.store()
    first = s.admit_batch([traj(0), traj(1, token=500), traj(0)], version=0)
    assert [r.status for r in first] == ["accepted", "rejected", "duplicate"]  # twice in one batch too
    assert first[2].reason == "already received; not trained again"
    again = s.admit_batch([traj(0), traj(1), traj(2)], version=0)
    assert [r.status for r in again] == ["duplicate", "duplicate", "accepted"]  # the rejected id is known
    counts = s.counts(buffered=2)
    assert (counts.accepted, counts.duplicate, counts.rejected) == (2, 3, 1)
    assert buffer.added == [("t0", 0), ("t2", 1)]  # log sequence numbers of accepted trajectories only


def test_an_evaluation_is_recorded_never_buffered_and_not_held_to_staleness(tmp_path):
    s, log, buffered = store(tmp_path)
    evaluation = traj(0, version=0, purpose="eval")
    assert s.admit(evaluation, version=9).status == "accepted"  # 9 versions old: fine for an evaluation
    assert s.admit(traj(1, version=0), version=9).status == "rejected"  # a training episode as old is stale
    assert buffered == [] and s.evaluated == 1 and s.accepted == 0 and s.next_lsn == 0
    log.close()
    assert [type(r) for r in read_records(tmp_path)] == [Evaluated, Rejected]


def test_a_buffer_without_room_refuses_the_batch_and_nothing_is_acknowledged(tmp_path):
    full = [True]

    def room(count: int, size: int) -> None:
        if full[0]:
            raise RateLimitError(f"no room for {count} trajectories ({size} bytes)", retry_after=1.0)

    buffer = Buffer()
    s = buffer.store(room=room)
    with pytest.raises(RateLimitError, match="no room for 1 trajectories"):
        s.admit_batch([traj(0), traj(1, token=500)], version=0)
    assert s.counts(0).model_dump() == TrajectoryStore(100, 2, lambda t, n: None).counts(0).model_dump()
    assert buffer.added == [] and buffer.absent == []
    assert [r.status for r in s.admit_batch([traj(1, token=500)], version=0)] == ["rejected"]  # no room needed
    full[0] = False
    assert [r.status for r in s.admit_batch([traj(0)], version=0)] == ["accepted"]  # the retry is no duplicate
    assert buffer.added == [("t0", 0)]


def test_counts_by_tag_turns_and_training():
    buffer = Buffer()
    signer = SampleSigner.random()
    s = buffer.store(signer=signer)
    math = [traj(i, task_tag="math") for i in range(3)]
    results = s.admit_batch([*math, signed(signer, 3), traj(4, task_tag="code")], version=0)
    assert {r.status for r in results} == {"accepted"}
    assert s.accepted_by_tag == {"math": 3, "": 1, "code": 1}
    s.mark_trained(4)
    counts = s.counts(buffered=1, aged_out_groups=2)
    assert (counts.accepted, counts.trained, counts.buffered, counts.aged_out_groups) == (5, 4, 1, 2)
    assert (counts.verified_turns, counts.unsigned_turns) == (1, 4)
    unkeyed = Buffer().store()  # a store without a key checks nothing: every turn counts as unsigned
    unkeyed.admit(signed(signer, 0), version=0)
    assert (unkeyed.verified_turns, unkeyed.unsigned_turns) == (0, 1)


def test_versions_and_admin_changes_are_logged_and_replays_are_not_counted_again(tmp_path):
    s, log, buffered = store(tmp_path)
    s.record_version(3)
    s.log_change(Configured({"lr": 0.1}, {"lr": 0.1}, paused=False))
    s.replay(traj(7), lsn=12)  # resume puts back what an earlier run accepted
    assert s.known_version == 3 and buffered == [("t7", 12)] and s.accepted == 0 and s.next_lsn == 0
    log.close()
    assert list(read_records(tmp_path)) == [Published(3), Configured({"lr": 0.1}, {"lr": 0.1}, False)]


def test_holding_the_lock_keeps_ingestion_still():
    buffer = Buffer()
    s = buffer.store()
    answered = threading.Event()
    with s.locked():
        pusher = threading.Thread(target=lambda: (s.admit(traj(0), version=0), answered.set()))
        pusher.start()
        assert not answered.wait(0.3) and buffer.added == []  # a checkpoint snapshots buffer and lsn meanwhile
    assert answered.wait(30) and buffer.added == [("t0", 0)]
    pusher.join()


def test_answers_survive_a_restart(tmp_path):
    s, log, buffered = store(tmp_path)
    results = s.admit_batch([traj(0), traj(1), traj(0), traj(2, token=500), traj(3, version=9)], version=0)
    assert [r.status for r in results] == ["accepted", "accepted", "duplicate", "rejected", "rejected"]
    assert buffered == [("t0", 0), ("t1", 1)]
    s.record_version(1)
    log.close()

    again, log2, buffered2 = store(tmp_path)
    assert buffered2 == []  # the store does not buffer by itself; resume replays (see runtime)
    assert again.accepted == 2 and dict(again.rejected) == {"invalid_tokens": 1, "future_version": 1}
    assert again.next_lsn == 2 and again.known_version == 1
    assert set(log2.scan.trajectories) == {0, 1} and log2.scan.trajectories[1]["id"] == "t1"
    statuses = [r.status for r in again.admit_batch([traj(1), traj(2, token=500), traj(4)], version=1)]
    assert statuses == ["duplicate", "duplicate", "accepted"]  # the rejected id is known too
    assert buffered2 == [("t4", 2)]
    log2.close()


def test_a_version_published_before_a_restart_is_not_from_the_future(tmp_path):
    s, log, _ = store(tmp_path)
    s.record_version(7)
    log.close()
    again, log2, _ = store(tmp_path)
    # resumed at v3 (its checkpoint); trajectories sampled at v5 by the previous run are fine
    assert again.admit(traj(0, version=5), version=3).status == "accepted"
    assert again.admit(traj(1, version=8), version=3).status == "rejected"
    log2.close()
