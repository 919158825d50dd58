"""Rollouts: the episodes of one run, started and played, each recorded and spooled for its servers.

``start_group`` starts one GRPO group (``size`` episodes of one task, under a group id unique to the run);
``start_eval`` starts an evaluation round over each code dir's held-out tasks at the current policy
version (never trained, reported apart). At most ``concurrency`` episodes play at once, each bounded by
``timeout``; an agent's exception or timeout fails that episode only. Every finished trajectory is
committed to the spool of each server it has turns for before the next one is taken.

An error of our own code around an episode (making its trajectory, recording it, spooling it) is no
failed episode: the future of ``watch()`` fails with it, and the runner ends the run (``abandon`` drops the
episodes still running, as a crash would; what is spooled stays there).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any, Literal

from agentjet_client.client import SwarmClient
from agentjet_client.delivery.sender import Sender
from agentjet_client.delivery.spool import WAITING
from agentjet_client.failures import Failure, FailureLog, StopRule, describe
from agentjet_client.logs import bind_ids
from agentjet_client.protocol import TrajectoryStatus
from agentjet_client.run.config import RunConfig
from agentjet_client.run.isolation import AgentFailed
from agentjet_client.run.judging import waiting_for
from agentjet_client.run.report import RunReport, coerce_reward
from agentjet_client.run.tracks import Track
from agentjet_client.tasks.agent import Task
from agentjet_client.tasks.rewards import Scored

logger = logging.getLogger(__name__)


class Rollouts:
    """The episodes of one run: started as groups or evaluation rounds, played, recorded and spooled."""

    def __init__(
        self,
        client: SwarmClient,
        tracks: Sequence[Track],
        senders: dict[str, Sender],
        report: RunReport,
        executor: Executor,
        config: RunConfig,
        *,
        on_progress: Callable[[RunReport], None] | None = None,
        stop_rule: StopRule | None = None,
        on_stop: Callable[[str], None] | None = None,
    ) -> None:
        self.client, self.tracks, self.senders, self.report = client, tracks, senders, report
        self.failures = FailureLog()
        self._stop_rule, self._on_stop = stop_rule, on_stop or (lambda reason: None)
        self.running: set[asyncio.Task[None]] = set()
        self.last_eval: int | None = None  # the policy version of the last evaluation round
        self._sem = asyncio.Semaphore(config.concurrency)
        self._executor = executor
        self._timeout = config.timeout
        self._eval_every, self._eval_episodes = config.eval_every, config.eval_episodes
        self._eval_rounds = 0
        self._on_progress = on_progress or (lambda report: None)
        self._failure: asyncio.Future[None] | None = None
        self.on_waiting: Callable[[], None] = lambda: None  # an episode was spooled to wait for its judge

    @property
    def version(self) -> int:
        """The newest policy version the default server told of."""
        return self.senders[self.client.server_url].version

    async def finish(self) -> None:
        """Wait for every episode started so far."""
        if self.running:
            await asyncio.gather(*self.running)

    def watch(self) -> asyncio.Future[None]:
        """A future (of the running loop; one per run) that fails with the next error our own code raises
        in an episode: the agent's own errors fail their episode only, this one ends the run."""
        self._failure = asyncio.get_running_loop().create_future()
        return self._failure

    async def abandon(self) -> None:
        """Cancel the episodes still running and wait until they have closed (their trajectories are lost,
        as in a crash; those already spooled stay in the spool)."""
        jobs = list(self.running)
        for job in jobs:
            job.cancel()
        await asyncio.gather(*jobs, return_exceptions=True)

    def _launch(
        self, track: Track, group_id: str, task_id: str, task: Task, evaluation: int | None = None, group_size: int = 1
    ) -> None:
        job = asyncio.create_task(self._episode(track, group_id, task_id, task, evaluation, group_size))
        self.running.add(job)
        job.add_done_callback(self._ended)

    def _ended(self, job: asyncio.Task[None]) -> None:
        self.running.discard(job)
        if job.cancelled() or (error := job.exception()) is None:
            return
        if self._failure is not None and not self._failure.done():
            self._failure.set_exception(error)
        else:  # one more while the run is already ending on the first
            logger.error("an episode failed in the runner's own code: %r", error, exc_info=error)

    def group_id(self, task_id: str, label: str) -> str:
        """The id of a new GRPO group of ``task_id`` (unique to this run through ``label``)."""
        return f"{task_id}@{self.client.client_id}:{label}"

    def start_group(
        self, track: Track, item: tuple[str, Task], group_id: str, size: int, group_size: int | None = None
    ) -> None:
        """Start ``size`` training episodes of one task in the GRPO group ``group_id`` (of ``group_size``
        episodes in all: more than ``size`` where a stopped run spooled some of them)."""
        task_id, task = item
        for _ in range(size):
            for sender in self.senders.values():
                sender.started(track.tag)
            self.report.started += 1
            self.report.episodes_by_tag[track.tag or ""] += 1
            track.episodes += 1
            self._launch(track, group_id, task_id, task, group_size=group_size or size)

    def eval_due(self) -> bool:
        """Whether an evaluation round should start now (``eval_every`` versions since the last)."""
        every = self._eval_every
        return bool(every) and (self.last_eval is None or self.version >= self.last_eval + every)

    async def start_eval(self) -> None:
        """Start a round of evaluation episodes over each code dir's eval tasks, in order."""
        version = self.last_eval = self.version
        self._eval_rounds += 1
        for track in self.tracks:
            if not track.has_eval_tasks and len(self.tracks) > 1:
                continue  # a code dir without held-out tasks is not evaluated (with one, load_tasks says so)
            tasks = await asyncio.to_thread(track.load_tasks, True)
            count = self._eval_episodes or len(tasks)
            logger.info("evaluation round %d: %d episodes at policy v%d", self._eval_rounds, count, version)
            for k in range(count):
                task_id, task = tasks[k % len(tasks)]
                self._launch(
                    track, f"eval:{task_id}@{self.client.client_id}:{self._eval_rounds}", task_id, task, version
                )

    async def _episode(
        self,
        track: Track,
        group_id: str,
        task_id: str,
        task: Task,
        evaluation: int | None = None,
        group_size: int = 1,
    ) -> None:
        """One episode (of a group of ``group_size``); ``evaluation`` (the policy version its round started
        at) makes it an evaluation episode: pushed as such, never trained, reported apart."""
        async with self._sem:
            agent, code_version = track.agent, track.code_version
            purpose: Literal["train", "eval"] = "eval" if evaluation is not None else "train"
            episode = self.client.episode(group_id, task_tag=track.tag, purpose=purpose)
            trace_id, span_id = episode.trace_ids
            # this task is the episode: its lines carry its ids
            bind_ids(
                episode_id=episode.id, trajectory_id=episode.id, task_id=task_id, trace_id=trace_id, span_id=span_id
            )
            status: TrajectoryStatus = "complete"
            error: str | None = None
            reward, agent_rewards = 0.0, None
            metadata: dict[str, Any] = {"task": task_id}
            if evaluation is None:
                metadata["group_size"] = group_size  # per-task figures count the group once all are in
            failure: Failure | None = None
            judge = track.judge
            try:
                value, ran = await track.play(agent, task, episode, self._timeout, self._executor)
                code_version = ran or code_version
                if judge is not None:  # rewarded once judged (``judging``): spooled to wait for it
                    metadata[WAITING] = waiting_for(judge, task, value, group_size, evaluation)
                elif isinstance(value, Scored):
                    reward, metadata["reward_components"] = value.reward, value.components
                else:
                    reward, agent_rewards = coerce_reward(value)
            except TimeoutError:
                timed_out = f"episode timed out after {self._timeout:g}s (--timeout)"
                failure = Failure(timed_out, timed_out)
            except AgentFailed as exc:  # raised in a worker process: its message is all there is
                failure = Failure(str(exc), exc.trace)
            except Exception as exc:  # the agent's bug fails this episode only
                failure = describe(exc)
            finally:
                await episode.aclose()
            if failure is not None:
                status, error = "failed", failure.line
                self.failures.record(task_id, failure)
            trajectory = episode.to_trajectory(
                reward,
                status=status,
                error=error,
                code_version=code_version,
                agent_rewards=agent_rewards,
                metadata=metadata,
            )
            rewarded = WAITING not in metadata  # a judged one's reward is recorded when the judge gives it
            self.report.record_episode(trajectory, evaluation, rewarded)
            if not rewarded:
                self.on_waiting()
            if evaluation is None and self._stop_rule is not None:
                reason = self._stop_rule.record(group_id, failure is not None)
                if reason is not None:
                    self._on_stop(reason)
            for server, part in self.client.split(trajectory).items():  # on disk before we go on
                await self.senders[server].put(part, evaluation is not None)
            self._on_progress(self.report)
