"""The runner: drive a ``SwarmAgent`` over its tasks, G episodes per task, and push the results.

For each task it starts one GRPO group (``group_size`` episodes of the same task id), at most
``concurrency`` episodes at a time, each bounded by ``timeout`` seconds. It starts a group only
while the server's admission budget (``/v1/status``) has room for it, so rollouts run ahead of
training by a bounded amount and land within the staleness bound. Finished trajectories are
pushed in batches by a background sender; an agent's exception or timeout fails that episode
only.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from agentjet_client.agent import SwarmAgent, Task
from agentjet_client.client import SwarmClient
from agentjet_client.errors import AgentJetError, RejectedRequest
from agentjet_client.protocol import Trajectory, TrajectoryStatus

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunConfig:
    episodes: int = 0  # 0 = run until stopped
    group_size: int = 8
    concurrency: int = 16
    timeout: float = 300.0
    admission: bool = True
    poll_interval: float = 0.2
    seed: int | None = None


@dataclass
class RunReport:
    rewards: list[float] = field(default_factory=list)
    started: int = 0
    finished: int = 0
    failed: int = 0
    accepted: int = 0
    duplicate: int = 0
    rejected: int = 0
    reject_reasons: Counter[str] = field(default_factory=Counter)
    failure_reasons: Counter[str] = field(default_factory=Counter)
    first_version: int | None = None
    last_version: int | None = None
    elapsed_s: float = 0.0

    def mean(self, lo: float, hi: float) -> float:
        """Mean reward over the fraction ``[lo, hi)`` of finished episodes, in finishing order."""
        n = len(self.rewards)
        part = self.rewards[int(n * lo) : max(int(n * lo) + 1, math.ceil(n * hi))]
        return sum(part) / len(part) if part else math.nan

    def recent_mean(self, window: int) -> float:
        part = self.rewards[-window:]
        return sum(part) / len(part) if part else math.nan


def _coerce_reward(value: Any) -> float:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float) and math.isfinite(value):
        return float(value)
    raise TypeError(f"the agent returned {value!r}; an agent must return its reward as a finite number")


class Runner:
    def __init__(
        self,
        client: SwarmClient,
        agent: SwarmAgent,
        config: RunConfig,
        *,
        code_version: str | None = None,
        on_progress: Callable[[RunReport], None] | None = None,
    ) -> None:
        self.client = client
        self.agent = agent
        self.config = config
        self.code_version = code_version
        self.report = RunReport()
        self._on_progress = on_progress or (lambda report: None)
        self._pending = 0  # episodes started and not yet answered by the server
        self._stop = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=max(1, config.concurrency), thread_name_prefix="agentjet-agent")

    def stop(self) -> None:
        self._stop.set()

    def _task_stream(self) -> Iterator[tuple[str, Task]]:
        rng = random.Random(self.config.seed)
        while True:
            tasks = self.agent.load_tasks()
            rng.shuffle(tasks)
            yield from tasks

    async def _wait_for_admission(self, need: int) -> None:
        if not self.config.admission:
            return
        while not self._stop.is_set():
            try:
                status = await asyncio.to_thread(self.client.status)
            except AgentJetError as exc:
                logger.warning("could not read server status for admission (%s); starting anyway", exc)
                return
            if self.report.first_version is None:
                self.report.first_version = status.policy_version
            if status.admission_budget - self._pending >= need or (self._pending == 0 and status.admission_budget > 0):
                return
            await asyncio.sleep(self.config.poll_interval)

    async def run(self) -> RunReport:
        started = time.monotonic()
        queue: asyncio.Queue[Trajectory] = asyncio.Queue()
        sender = asyncio.create_task(self._send_loop(queue))
        sem = asyncio.Semaphore(self.config.concurrency)
        episodes: set[asyncio.Task[None]] = set()
        g = self.config.group_size
        total_groups = math.ceil(self.config.episodes / g) if self.config.episodes else None
        tasks = self._task_stream()
        groups = 0
        try:
            while not self._stop.is_set() and (total_groups is None or groups < total_groups):
                await self._wait_for_admission(g)
                if self._stop.is_set():
                    break
                task_id, task = next(tasks)
                group_tag = f"{task_id}@{self.client.client_id}:{groups}"
                for _ in range(g):
                    self._pending += 1
                    self.report.started += 1
                    job = asyncio.create_task(self._episode(sem, queue, group_tag, task_id, task))
                    episodes.add(job)
                    job.add_done_callback(episodes.discard)
                groups += 1
            if episodes:
                await asyncio.gather(*episodes)
            await queue.join()
        finally:
            sender.cancel()
            self._executor.shutdown(wait=False, cancel_futures=True)
            await self.client.aclose_pool()
        self.report.elapsed_s = time.monotonic() - started
        return self.report

    async def _episode(
        self, sem: asyncio.Semaphore, queue: asyncio.Queue[Trajectory], group_id: str, task_id: str, task: Task
    ) -> None:
        async with sem:
            agent, code_version = self.agent, self.code_version
            episode = self.client.episode(group_id, task_tag=agent.tag)
            status: TrajectoryStatus = "complete"
            error: str | None = None
            reward = 0.0
            try:
                if agent.is_async:
                    value = await asyncio.wait_for(agent.fn(task, episode), self.config.timeout)
                else:
                    loop = asyncio.get_running_loop()
                    value = await asyncio.wait_for(
                        loop.run_in_executor(self._executor, agent.fn, task, episode), self.config.timeout
                    )
                reward = _coerce_reward(value)
            except TimeoutError:
                status, error = "failed", f"episode timed out after {self.config.timeout:g}s"
            except Exception as exc:  # the agent's bug fails this episode only
                status = "failed"
                error = "".join(traceback.format_exception_only(exc)).strip()
                logger.warning("episode of task %s failed: %s", group_id, error)
            finally:
                await episode.aclose()
            trajectory = episode.to_trajectory(
                reward,
                status=status,
                error=error,
                code_version=code_version,
                metadata={"task": task_id},
            )
            self.report.finished += 1
            if trajectory.status == "complete":
                self.report.rewards.append(reward)
            else:
                self.report.failed += 1
                self.report.failure_reasons[(trajectory.error or "unknown")[:120]] += 1
            await queue.put(trajectory)
            self._on_progress(self.report)

    async def _send_loop(self, queue: asyncio.Queue[Trajectory]) -> None:
        while True:
            batch = [await queue.get()]
            await asyncio.sleep(0.05)  # let siblings that finish together travel together
            while not queue.empty() and len(batch) < 256:
                batch.append(queue.get_nowait())
            while True:
                try:
                    answer = await asyncio.to_thread(self.client.submit, batch)
                    break
                except RejectedRequest as exc:
                    logger.error("server refused a batch of %d trajectories: %s", len(batch), exc.message)
                    self.report.rejected += len(batch)
                    self.report.reject_reasons[exc.message[:80]] += len(batch)
                    answer = None
                    break
                except AgentJetError as exc:
                    logger.warning("submit failed (%s); retrying in 2s, nothing is dropped", exc)
                    await asyncio.sleep(2.0)
            if answer is not None:
                self.report.last_version = answer.policy_version
                for result in answer.results:
                    if result.status == "accepted":
                        self.report.accepted += 1
                    elif result.status == "duplicate":
                        self.report.duplicate += 1
                    else:
                        self.report.rejected += 1
                        self.report.reject_reasons[(result.reason or "")[:60]] += 1
            self._pending -= len(batch)
            for _ in batch:
                queue.task_done()
