"""The admission window (``admission.AdmissionWindow``): at ``--admission-batches`` while the learner has batches
ready; half a batch more after each step the learner waited for while the trained tokens' lag has two versions
of room under ``--max-staleness``; a batch less when the lag reaches the bound; back toward the least while the
learner does not wait; never over the bound in batches nor half the buffer. Then on a real server: episodes whose
groups wait on a slow sibling make the learner wait, the window grows, and ``/v1/status`` shows it."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter

import httpx2

from agentjet_client import RunConfig, Runner, Spool, SwarmClient, swarm_agent
from agentjet_server.admission import AdmissionWindow, lag_quantile
from agentjet_server.settings import ServerSettings
from tests.conftest import LiveServer

ASK = [{"role": "user", "content": "Write four as a digit."}]

SETTINGS = ServerSettings(batch_groups=2, group_size=4, max_staleness=4, admission_batches=2)
BUFFERED = 4 * 2 * 4 * 2  # the default --max-buffered of these settings: four windows


def stepped(window: AdmissionWindow, lag: dict[int, int], waited: float, step: float = 1.0) -> float:
    window.after_step(SETTINGS, BUFFERED, Counter(lag), waited, step)
    return window.current(SETTINGS, BUFFERED)


def test_the_lag_quantile_counts_tokens() -> None:
    assert lag_quantile(Counter({0: 95, 3: 5})) == 0
    assert lag_quantile(Counter({0: 94, 3: 6})) == 3
    assert lag_quantile(Counter({2: 1})) == 2
    assert lag_quantile(Counter()) == 0


def test_the_window_grows_while_the_learner_starves_and_the_lag_has_room() -> None:
    window = AdmissionWindow()
    assert window.current(SETTINGS, BUFFERED) == 2.0
    assert stepped(window, {0: 10}, waited=0.1) == 2.0  # it hardly waited: nothing to gain
    assert [stepped(window, {0: 10, 1: 10}, waited=1.0) for _ in range(3)] == [2.5, 3.0, 3.5]
    assert stepped(window, {2: 10}, waited=1.0) == 4.0  # lag 2 + 2 <= 4: still room
    assert stepped(window, {1: 10}, waited=1.0) == 4.0  # the bound in batches: no further
    assert stepped(window, {3: 10}, waited=1.0) == 4.0  # waiting, but the lag has no room to grow: held
    assert stepped(window, {4: 10}, waited=1.0) == 3.0  # at the bound: a batch less at once
    window.after_step(SETTINGS, BUFFERED, Counter({0: 10}), 1.0, 1.0, stale=1)  # an episode aged past it
    assert window.current(SETTINGS, BUFFERED) == 2.0
    assert stepped(window, {1: 10}, waited=1.0) == 2.5
    assert stepped(window, {1: 10}, waited=1.0) == 3.0
    assert [stepped(window, {1: 10}, waited=0.0) for _ in range(5)] == [2.75, 2.5, 2.25, 2.0, 2.0]
    assert window.batches is None  # back at --admission-batches


def test_the_window_stays_under_half_the_buffer_and_never_under_the_flag() -> None:
    small_buffer = 2 * 2 * 4 * 2 + 8  # room for 2.25 windows: the window stops at half of it
    window = AdmissionWindow()
    for _ in range(10):
        window.after_step(SETTINGS, small_buffer, Counter({0: 1}), 5.0, 1.0)
    assert window.current(SETTINGS, small_buffer) == small_buffer / (2 * 8)
    wide = SETTINGS.model_copy(update={"admission_batches": 6})
    assert AdmissionWindow().current(wide, BUFFERED) == 6.0  # the flag is the least, whatever the bound
    strict = SETTINGS.model_copy(update={"max_staleness": 0})
    window = AdmissionWindow()
    window.after_step(strict, BUFFERED, Counter({0: 1}), 5.0, 1.0)
    assert window.current(strict, BUFFERED) == 2.0  # on-policy only: no room to run ahead


def slow_tailed_agent():
    rng = random.Random(0)

    @swarm_agent(tasks=[{"id": f"t{k}"} for k in range(4)])
    async def agent(task, episode):
        reply = await episode.async_openai().chat.completions.create(model="any", messages=ASK, max_tokens=3)
        if rng.random() < 0.25:  # about one episode of each group of 4 takes its environment a while
            await asyncio.sleep(0.6)
        return float(len(reply.choices[0].message.content or "")) + rng.random()  # rewards that differ

    return agent


def test_a_server_whose_groups_wait_on_slow_siblings_widens_its_window(model_dir, tmp_path) -> None:
    """Groups of 4 where about one episode in four takes 0.6 s: the finished ones fill a window of one batch, the
    learner waits for complete groups, and the window grows (the status says so) with the lag under the bound."""
    server = LiveServer(model_dir, batch_groups=1, group_size=4, max_staleness=4, admission_batches=1)
    try:
        windows: list[float] = []

        async def run() -> None:
            client = SwarmClient(server.url)
            config = RunConfig(group_size=4, concurrency=16, seed=0)
            runner = Runner(client, slow_tailed_agent(), config, spool=Spool(tmp_path / "spool"))
            job = asyncio.create_task(runner.run())
            deadline = time.monotonic() + 240
            while server.runtime.loop.trainer.steps < 12:
                assert time.monotonic() < deadline and not job.done()
                windows.append(server.runtime.status().learner.admission_window or 0.0)
                await asyncio.sleep(0.2)
            runner.stop()
            await job
            client.close()

        asyncio.run(run())
        status = httpx2.get(server.url + "/v1/status").json()
        assert windows[0] == 1.0 and max(windows) > 1.0, windows
        assert max(windows) <= 2.0  # half of the default buffer (four windows of one batch)
        assert max(int(k) for k in status["learner"]["trained_token_lag"]) <= 4
    finally:
        server.stop()
