"""Delivery against a real server: a spooled backlog larger than the server takes in one push is sent in
smaller pushes (a 413 halves the batch), never settled as rejected."""

from __future__ import annotations

import asyncio
from pathlib import Path

from agentjet_client import SwarmClient
from agentjet_client.delivery.sender import DeliveryCounts, Sender
from agentjet_client.delivery.spool import Spool
from agentjet_client.protocol import ClientReport
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

            async def deliver() -> None:
                job = asyncio.create_task(sender.run())
                while spool.depth:
                    assert not job.done(), job
                    await asyncio.sleep(0.05)
                job.cancel()

            asyncio.run(asyncio.wait_for(deliver(), 60))
            stats = spool.stats()
            spool.close()
    finally:
        server.stop()
    assert stats.accepted == 10 and stats.rejected == 0 and report.rejected == 0
