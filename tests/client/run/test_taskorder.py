"""The task order: seeded epochs of tasks x repeats, an end after ``epochs``, and a restarted run that
continues where the spool says the killed one stood (open groups finished with only what they lack)."""

from __future__ import annotations

import logging
from collections import Counter

from agentjet_client.delivery.spool import Spool
from agentjet_client.protocol import Trajectory, Turn
from agentjet_client.run.taskorder import TaskOrder

TASKS = [(f"t{i}", {"id": f"t{i}"}) for i in range(7)]


def spooled(spool: Spool, group_id: str, n: int, start: int = 0) -> None:
    turn = Turn(
        policy_version=0,
        prompt_token_ids=[1, 2],
        completion_token_ids=[3],
        completion_logprobs=[-0.1],
        finish_reason="stop",
    )
    spool.put_many(
        [Trajectory(id=f"{group_id}/{start + k}", task_id=group_id, turns=[turn], reward=0.0) for k in range(n)]
    )


def play(order: TaskOrder, groups: int | None = None) -> list[str]:
    """Start groups (noting them in the spool) and return their task ids, until ``groups`` or the end."""
    ids = []
    while groups is None or len(ids) < groups:
        planned = order.next()
        if planned is None:
            break
        order.opened(planned, planned.group_id or f"g{planned.position}", 4)
        ids.append(planned.task_id)
    return ids


def test_epochs_repeats_and_a_seeded_shuffle():
    ids = play(TaskOrder(lambda: list(TASKS), "a", seed=3, epochs=2, repeats=3))
    assert len(ids) == 2 * 3 * 7
    for epoch in (ids[:21], ids[21:]):
        assert Counter(epoch) == {task_id: 3 for task_id, _ in TASKS}  # each task 3 times in each epoch
    assert ids[:21] != ids[21:]  # each epoch its own order
    assert ids == play(TaskOrder(lambda: list(TASKS), "a", seed=3, epochs=2, repeats=3))  # same seed, same order
    assert ids != play(TaskOrder(lambda: list(TASKS), "a", seed=4, epochs=2, repeats=3))
    plain = play(TaskOrder(lambda: list(TASKS), "a", epochs=1, shuffle=False))
    assert plain == [task_id for task_id, _ in TASKS]


def test_a_restarted_run_finishes_the_open_groups_and_continues_the_order(tmp_path):
    spool = Spool(tmp_path)
    first = TaskOrder(lambda: list(TASKS), "0:agent", spool=spool, epochs=2)  # no seed: one is drawn and kept
    started = play(first, 5)
    for position in range(3):  # groups 0-2 complete, 3 has 2 of 4 episodes spooled, 4 none: then the kill
        spooled(spool, f"g{position}", 4)
    spooled(spool, "g3", 2)
    spool.close()

    spool = Spool(tmp_path)
    second = TaskOrder(lambda: list(TASKS), "0:agent", spool=spool, epochs=2)
    resumed = [second.next() for _ in range(2)]
    assert [(p.position, p.group_id, p.episodes) for p in resumed if p] == [(3, "g3", 2), (4, "g4", 4)]
    assert [p.task_id for p in resumed if p] == started[3:5]
    rest = play(second)
    whole = started + rest
    assert len(whole) == 14 and Counter(whole[:7]) == Counter(whole[7:]) == {t: 1 for t, _ in TASKS}
    assert second.resumed == 2
    assert second.continued == (
        "finished 2 groups a stopped run left open in the spool, then went on with its task order from group 5"
    )
    spool.close()
    spool = Spool(tmp_path)  # a run that ended between groups (its last one complete): nothing was stopped
    spooled(spool, "g3", 2, start=2)
    for position in range(4, 14):
        spooled(spool, f"g{position}", 4)
    third = TaskOrder(lambda: list(TASKS), "0:agent", spool=spool, epochs=3)
    assert third.next() is not None and third.resumed == 0
    assert third.continued == (
        "the task order went on from group 14, where the last run with this spool left it (a new --seed or "
        "--spool-dir starts it afresh)"
    )


def test_another_seed_or_other_tasks_start_the_order_afresh(tmp_path, caplog):
    spool = Spool(tmp_path)
    play(TaskOrder(lambda: list(TASKS), "x", spool=spool, seed=1), 4)
    with caplog.at_level(logging.WARNING):
        again = TaskOrder(lambda: list(TASKS), "x", spool=spool, seed=2)
        planned = again.next()
        assert planned is not None and planned.position == 0
        again.opened(planned, "h0", 4)
    assert "its task order starts afresh" in caplog.text
    caplog.clear()
    same = TaskOrder(lambda: list(TASKS), "x", spool=spool)  # no --seed: the kept one (2), where it stood
    first, after = same.next(), same.next()
    assert first is not None and (first.position, first.group_id, first.episodes) == (0, "h0", 4)  # still open
    assert (
        after is not None
        and after.position == 1
        and after.task_id == play(TaskOrder(lambda: list(TASKS), "y", seed=2), 2)[1]
    )
    other = TaskOrder(lambda: TASKS[:5], "x", spool=spool)
    with caplog.at_level(logging.WARNING):
        assert other.next().position == 0  # type: ignore[union-attr]
    assert "starts afresh" in caplog.text
