"""The learner thread's mailbox: what the admin API asks is carried out between steps, in order,
each request answered with its own result or error, and nothing left unanswered when the loop stops."""

from __future__ import annotations

import threading

import pytest

from agentjet_server.errors import StateError
from agentjet_server.learner.requests import Requests


def test_work_runs_on_the_thread_that_takes_it_in_order_with_each_result_or_error():
    woken = threading.Event()
    requests = Requests(woken.set)
    ran_on: list[str] = []

    def work(n: int) -> int:
        ran_on.append(threading.current_thread().name)
        if n == 2:
            raise ValueError("two is refused")
        return n * 10

    futures = [requests.call(lambda n=n: work(n)) for n in (1, 2, 3)]  # type: ignore[misc]
    assert woken.is_set() and not any(f.done() for f in futures)
    learner = threading.Thread(target=lambda: requests.run(requests.take()[2]), name="learner")
    learner.start()
    learner.join(timeout=10)
    assert ran_on == ["learner"] * 3
    assert futures[0].result() == 10 and futures[2].result() == 30
    with pytest.raises(ValueError, match="two is refused"):
        futures[1].result()
    assert requests.take() == (None, [], [])  # taken once


def test_the_newest_settings_win_checkpoints_are_shared_and_a_stopping_loop_refuses_work():
    requests = Requests(lambda: None)
    requests.reconfigure("first")
    requests.reconfigure("second")
    a, b = requests.checkpoint(), requests.checkpoint()
    work = requests.call(lambda: "never")
    config, checkpoints, calls = requests.take()
    assert config == "second" and checkpoints == [a, b]
    requests.run(calls, stopping=True)
    with pytest.raises(StateError, match="stopping"):
        work.result(timeout=1)
