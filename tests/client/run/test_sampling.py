"""Dynamic sampling: on a task set where half the tasks are always solved, fewer groups carry no gradient
than without it, same seed and the same number of episodes (a real server, real episodes)."""

from __future__ import annotations

import asyncio
import random

from agentjet_client import RunConfig, Runner, SwarmClient, swarm_agent
from agentjet_client.run.sampling import TaskRates

ASK = [{"role": "user", "content": "Write four as a digit."}]
TASKS = [{"id": f"easy-{i}"} for i in range(4)] + [{"id": f"open-{i}"} for i in range(4)]


def make_agent(seed: int):
    rng = random.Random(seed)

    @swarm_agent(tasks=TASKS)
    async def agent(task, episode):
        await episode.async_openai().chat.completions.create(model="agentjet-tiny", messages=ASK, max_tokens=1)
        # always solved, or a reward that differs within a group: only the second kind has a gradient
        return 1.0 if task["id"].startswith("easy") else rng.random()

    return agent


def test_task_rates_count_tied_groups_and_skip_saturated_tasks_at_the_keep_rate():
    rates = TaskRates(window=2, keep=0.25, seed=0)
    for group in range(3):
        for _ in range(4):
            rates.observe(f"e{group}", "easy", 1.0, 4)
        rates.observe(f"o{group}", "open", 0.0, 2)
        rates.observe(f"o{group}", "open", None, 2)  # a failed episode: the group is not tied
    assert rates.tasks["easy"].groups == 3 and rates.tasks["easy"].tied == 3 and rates.tasks["open"].tied == 0
    assert rates.saturated("easy") and not rates.saturated("open")
    skips = sum(rates.skip("easy") for _ in range(2000))
    assert 0.7 < skips / 2000 < 0.8 and not any(rates.skip("open") for _ in range(100))


def test_dynamic_sampling_passes_over_always_solved_tasks_and_cuts_the_tied_share(live_server):
    shares = {}
    for dynamic in (False, True):
        with SwarmClient(live_server.url) as client:
            config = RunConfig(episodes=160, group_size=2, concurrency=8, seed=7, dynamic_sampling=dynamic)
            report = asyncio.run(Runner(client, make_agent(7), config).run())
        assert report.finished == 160 and report.failed == 0
        shares[dynamic] = report.tasks.tied_share
        easy = sum(f.groups for task, f in report.tasks.tasks.items() if task.startswith("easy"))
        print(
            f"dynamic sampling {'on' if dynamic else 'off'}: groups with equal rewards {shares[dynamic]:.0%}, "
            f"always-solved groups {easy} of 80, passed over {sum(report.tasks.skipped.values())}"
        )
    assert 0.4 < shares[False] < 0.6  # half the tasks always solved, the other half never tied
    assert shares[True] < shares[False] - 0.15
