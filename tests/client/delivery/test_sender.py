"""Delivery against a real server: a spooled backlog larger than the server takes in one push is sent in
smaller pushes (a 413 halves the batch), never settled as rejected; a push that does not fit the room left in
a buffer full of unfinished groups (429) is sent in pieces that do, so those groups complete and train; an item
spooled while the sender looks at an empty spool is still sent."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from agentjet_client import SwarmClient
from agentjet_client.delivery.sender import DeliveryCounts, Sender
from agentjet_client.delivery.spool import Spool
from agentjet_client.protocol import ClientReport, Trajectory
from tests.conftest import LiveServer

ASK = [{"role": "user", "content": "Write seven as a digit."}]


def test_a_backlog_bigger_than_the_servers_buffer_is_sent_in_smaller_pushes(model_dir: Path, tmp_path: Path) -> None:
    server = LiveServer(model_dir, max_buffered=6, batch_groups=1, group_size=2, max_staleness=100)
    try:
        with SwarmClient(server.url) as client:
            spool = Spool(tmp_path / "spool")
            for k in range(10):
                episode = client.episode(f"group-{k // 2}")
                episode.openai().chat.completions.create(model="m", messages=ASK, max_tokens=3)
                spool.put(episode.to_trajectory(float(k % 2)))
                episode.close()
            report = DeliveryCounts()
            sender = Sender(client, server.url, spool, report, lambda s, n: ClientReport(id="t"), backoff_max=0.5)
            _drain(sender, spool, 60)
            stats = spool.stats()
            spool.close()
    finally:
        server.stop()
    assert stats.accepted == 10 and stats.rejected == 0 and report.rejected == 0


def _played(client: SwarmClient, group: str, reward: float) -> Trajectory:
    episode = client.episode(group)
    episode.openai().chat.completions.create(model="m", messages=ASK, max_tokens=3)
    trajectory = episode.to_trajectory(reward)
    episode.close()
    return trajectory


def _drain(sender: Sender, spool: Spool, seconds: float) -> None:
    async def deliver() -> None:
        job = asyncio.create_task(sender.run())
        while spool.depth:
            assert not job.done(), job
            await asyncio.sleep(0.05)
        job.cancel()

    asyncio.run(asyncio.wait_for(deliver(), seconds))


def test_a_push_that_does_not_fit_a_buffer_of_unfinished_groups_goes_in_pieces_that_do(
    model_dir: Path, tmp_path: Path
) -> None:
    # the buffer takes 8; two groups of 4 wait there with 3 members each (a step trains 2 whole groups, and no
    # group timeout ends them): the spool holds their last members and a third group. The 6 spooled do not fit
    # the 2 places left (429) and never will until the two groups complete, which only the spooled items can do.
    server = LiveServer(model_dir, max_buffered=8, batch_groups=2, group_size=4, group_timeout_s=600, max_staleness=100)
    try:
        with SwarmClient(server.url) as client:
            waiting = [_played(client, group, float(k % 2)) for group in ("a", "b") for k in range(4)]
            client.submit([t for i, t in enumerate(waiting) if i % 4 != 3])
            assert server.runtime.buffer.buffered == 6
            spool = Spool(tmp_path / "spool")
            spool.put_many([waiting[3], waiting[7], *[_played(client, "c", float(k % 2)) for k in range(4)]])
            report = DeliveryCounts()
            sender = Sender(client, server.url, spool, report, lambda s, n: ClientReport(id="t"), backoff_max=0.5)
            _drain(sender, spool, 60)
            stats = spool.stats()
            spool.close()
            deadline = time.monotonic() + 30
            while server.runtime.loop.learner.steps < 1:  # groups a and b completed and trained
                assert time.monotonic() < deadline, "groups a and b never trained"
                time.sleep(0.05)
    finally:
        server.stop()
    assert stats.accepted == 6 and stats.rejected == 0 and report.rejected == 0


def test_an_item_spooled_while_the_sender_looks_at_an_empty_spool_is_sent(model_dir: Path, tmp_path: Path) -> None:
    server = LiveServer(model_dir, batch_groups=1, group_size=2, max_staleness=100)
    try:
        with SwarmClient(server.url) as client:
            spool = Spool(tmp_path / "spool")
            report = DeliveryCounts()
            sender = Sender(client, server.url, spool, report, lambda s, n: ClientReport(id="t"))
            trajectory = _played(client, "late", 1.0)
            looked = asyncio.Event()
            peek = spool.peek

            def slow_peek(limit: int) -> list[tuple[str, Trajectory]]:  # the item arrives while the sender looks
                found = peek(limit)
                loop.call_soon_threadsafe(looked.set)
                time.sleep(0.3)
                return found

            spool.peek = slow_peek  # type: ignore[method-assign]

            async def deliver() -> None:
                nonlocal loop
                loop = asyncio.get_running_loop()
                job = asyncio.create_task(sender.run())
                await looked.wait()  # the sender found the spool empty; it has not gone to sleep yet
                await sender.put(trajectory, False)
                while sender.mine:  # answered and counted (the spool's row goes a moment before the count)
                    assert not job.done(), job
                    await asyncio.sleep(0.05)
                job.cancel()

            loop: asyncio.AbstractEventLoop
            asyncio.run(asyncio.wait_for(deliver(), 60))
            stats = spool.stats()
            spool.close()
    finally:
        server.stop()
    assert stats.accepted == 1 and report.accepted == 1
