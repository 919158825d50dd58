"""A cocktail: runs of two task families against one server, their mix set by the server."""

from __future__ import annotations

import asyncio
import time

import httpx2

from agentjet_client import RunConfig, Runner, Spool, SwarmClient, swarm_agent
from tests.conftest import LiveServer

ASK = [{"role": "user", "content": "Write four as a digit."}]


def family(tag: str):
    @swarm_agent(tasks=[{"id": f"{tag}-{k}"} for k in range(3)], tag=tag)
    async def agent(task, episode):
        reply = await episode.async_openai().chat.completions.create(model="any", messages=ASK, max_tokens=3)
        return float(reply.choices[0].message.content.strip() == "4")

    return agent


def test_the_server_mix_sets_what_each_task_family_gets_trained(model_dir, tmp_path):
    server = LiveServer(model_dir, batch_groups=2, group_size=4, mix={"a": 3, "b": 1})
    try:
        status = httpx2.get(server.url + "/v1/status").json()
        assert status["by_tag"]["a"]["share"] == 0.75 and status["by_tag"]["a"]["admission_budget"] == 12
        assert status["by_tag"]["b"]["admission_budget"] == 4  # a quarter of a window of 16 episodes

        async def cocktail(target: int) -> None:
            runs = []
            for tag in ("a", "b"):  # two runs, as two clients would (each knows only its own tag)
                client = SwarmClient(server.url)
                config = RunConfig(group_size=4, concurrency=8, seed=0)
                runs.append((client, Runner(client, family(tag), config, spool=Spool(tmp_path / tag))))
            jobs = [asyncio.create_task(runner.run()) for _, runner in runs]
            deadline = time.monotonic() + 240
            while server.runtime.loop.tags.figures()[0].total() < target:
                assert time.monotonic() < deadline and not any(job.done() for job in jobs)
                await asyncio.sleep(0.2)
            for _, runner in runs:
                runner.stop()
            await asyncio.gather(*jobs)
            for client, _ in runs:
                client.close()

        asyncio.run(cocktail(320))
        by_tag = httpx2.get(server.url + "/v1/status").json()["by_tag"]
        a, b = by_tag["a"]["trained"], by_tag["b"]["trained"]
        print(f"mix a=3,b=1: trained a {a}, b {b} (ratio {a / b:.2f})")
        assert 2.7 <= a / b <= 3.3
        assert by_tag["a"]["mean_reward"] is not None and by_tag["a"]["mean_lag"] is not None
        metrics = httpx2.get(server.url + "/metrics").text
        assert f'agentjet_tag_episodes{{state="trained",tag="a"}} {float(a)}' in metrics

        # the mix is a live setting: turned around, b is now invited and a held back
        answer = httpx2.patch(server.url + "/v1/admin/config", json={"mix": {"a": 1, "b": 3}})
        assert answer.status_code == 200, answer.text
        by_tag = httpx2.get(server.url + "/v1/status").json()["by_tag"]
        assert by_tag["a"]["admission_budget"] == 0 and by_tag["b"]["admission_budget"] > 0
        bad = httpx2.patch(server.url + "/v1/admin/config", json={"mix": {"a": -1}})
        assert bad.status_code == 400 and "positive" in bad.text
    finally:
        server.stop()
