"""The runner: drive a ``SwarmAgent`` over its tasks, G episodes per task, and push the results.

For each task it starts one GRPO group (``group_size`` episodes of the same task id), at most
``concurrency`` episodes at a time, each bounded by ``timeout`` seconds. It starts a group only
while the server's admission budget (``/v1/status``) has room for it, so rollouts run ahead of
training by a bounded amount and land within the staleness bound. An agent's exception or
timeout fails that episode only; an error of our own code (around an episode, or in a sender) ends
the run at once with that error, the episodes still running abandoned as in a crash, everything
spooled kept for the next run.

Every finished trajectory is committed to the durable spool of its server before the runner
moves on, and delivered from there by that server's ``delivery.Sender``; with agents on several
servers (``SwarmClient(agents=...)``, ``--server NAME=URL``) each server gets its own part of the
episode (``SwarmClient.split``), its own spool and its own sender. Groups start when every server
has room (``admission.Admission``). A run ends when its own episodes are finished and answered.

``sync`` runs the classic synchronous loop instead, the baseline that asynchronous training is
measured against: start one batch of groups (the server's ``batch_groups`` x ``group_size``),
wait until every episode has finished and been answered, wait until the learner has trained on
them and their policy update is live, and only then start the next batch. Every turn is sampled
by the weights the learner updates next (staleness 0); the learner waits for the slowest episode
of each batch, and the rollouts wait for each step. Meant for one client per server.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from agentjet_client.client import SwarmClient
from agentjet_client.delivery.admission import Admission
from agentjet_client.delivery.sender import Sender
from agentjet_client.delivery.spool import Spool, default_spool_dir, spool_key
from agentjet_client.failures import StopRule
from agentjet_client.protocol import ClientReport
from agentjet_client.run.config import RunConfig
from agentjet_client.run.isolation import WorkerPool
from agentjet_client.run.judging import judging_stages, wake_all
from agentjet_client.run.loader import CodeWatcher
from agentjet_client.run.report import RunReport
from agentjet_client.run.rollout import Rollouts
from agentjet_client.run.sampling import TaskRates
from agentjet_client.run.taskorder import GroupStarts
from agentjet_client.run.tracks import RemoteAgent, Track
from agentjet_client.tasks.agent import SwarmAgent

logger = logging.getLogger(__name__)


class Runner:
    """Runs an agent (or several code dirs' agents) over its tasks against its servers: groups start as
    admission allows, episodes play (``rollout``), trajectories are spooled and delivered; ``run``
    returns the ``RunReport`` once every episode is answered (see the module docstring)."""

    def __init__(
        self,
        client: SwarmClient,
        agent: SwarmAgent | Sequence[Track],
        config: RunConfig,
        *,
        code_version: str | None = None,
        on_progress: Callable[[RunReport], None] | None = None,
        spool: Spool | None = None,
        spools: dict[str, Spool] | None = None,
        watcher: CodeWatcher | None = None,
        on_reload: Callable[[str, str | None], None] | None = None,
        workers: WorkerPool | None = None,
    ) -> None:
        self.client = client
        if isinstance(agent, SwarmAgent):
            self.tracks = [Track(agent, code_version, watcher, workers)]
        else:  # several code dirs (``tracks.open_track``): the single-agent arguments do not apply
            if code_version is not None or watcher is not None or workers is not None:
                raise ValueError("give code_version, watcher and workers in each Track, not to the Runner")
            self.tracks = list(agent)
            if not self.tracks:
                raise ValueError("a run needs at least one agent")
        self.config = config
        self.report = RunReport(tasks=TaskRates(seed=config.seed))
        # one spool and sender per server: ``spool`` is the default server's, ``spools`` any server's
        given = {**({client.server_url: spool} if spool is not None else {}), **(spools or {})}
        self.senders = {
            server: Sender(
                client,
                server,
                given.get(server) or Spool(default_spool_dir() / spool_key(server)),
                self.report.delivered,
                self._client_report,
                batch=config.send_batch,
                backoff_max=config.backoff_max,
            )
            for server in client.servers
        }
        self.spool = self.senders[client.server_url].spool
        self.admission = Admission(
            client,
            self.senders,
            self.report.admitted,
            self._stop_requested,
            enabled=config.admission,
            poll_interval=config.poll_interval,
            backoff_max=config.backoff_max,
        )
        self._on_reload = on_reload or (lambda version, error: None)
        self._stop = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=max(1, config.concurrency), thread_name_prefix="agentjet-agent")
        self.rollouts = Rollouts(
            client,
            self.tracks,
            self.senders,
            self.report,
            self._executor,
            config,
            on_progress=on_progress,
            stop_rule=StopRule(config.group_size, config.episodes, config.max_failure_rate),
            on_stop=self._stop_failing,
        )

        judges = [t.judge for t in self.tracks if t.judge is not None]
        spools = {server: sender.spool for server, sender in self.senders.items()}
        self.judging = judging_stages(judges, spools, client.server_url, self.report, self._wake_senders)
        self.rollouts.on_waiting = functools.partial(wake_all, self.judging)

    def _wake_senders(self) -> None:
        for sender in self.senders.values():
            sender.wake()

    def stop(self) -> None:
        self._stop.set()

    def _stop_failing(self, reason: str) -> None:
        if self.report.stopped is None:
            self.report.stopped = reason
            logger.error("stopping the run: %s", reason)
        self.stop()

    def _stop_requested(self) -> bool:
        return self._stop.is_set()

    @property
    def unanswered(self) -> int:
        """Trajectories of this run spooled and not yet answered by their servers."""
        return sum(len(sender.mine) for sender in self.senders.values())

    @property
    def agent(self) -> SwarmAgent | RemoteAgent:
        """The agent of the (first) code dir."""
        return self.tracks[0].agent

    @property
    def code_version(self) -> str | None:
        versions = [t.code_version for t in self.tracks if t.code_version is not None]
        return ",".join(versions) if versions else None

    async def _wait_for_admission(self, need: int, ended: set[int]) -> int | None:
        """The index of the track whose next group may start now (None once the run stops): of those with
        room on every server whose order has not ``ended``, the one with the most room for its tag; on a
        tie, the one that has started fewest episodes (without ``--mix`` the code dirs take turns)."""
        await self.admission.spool_room()
        room = await self.admission.choose(need, [track.tag for track in self.tracks])
        room = {i: free for i, free in room.items() if i not in ended}
        if not room:
            return None
        return max(room, key=lambda i: (room[i], -self.tracks[i].episodes, -i))

    async def run(self) -> RunReport:
        started = time.monotonic()
        if self.config.sync and len(self.senders) > 1:
            raise ValueError("--sync drives one server; run the agents of other servers without --sync")
        if self.config.sync and len(self.tracks) > 1:
            raise ValueError("--sync runs one code dir; give one --code-dir")
        senders = [asyncio.create_task(sender.run()) for sender in self.senders.values()]
        senders += [asyncio.create_task(stage.run()) for stage in self.judging]  # none ends but by failing
        interval = self.config.watch_interval
        watching = [
            asyncio.create_task(t.watch(interval, self.report, self._on_reload))
            for t in self.tracks
            if t.watcher is not None
        ]
        failure = self.rollouts.watch()
        drive = asyncio.create_task(self._drive(senders))
        try:
            await _supervise(drive, [failure, *senders])
        finally:
            failure.cancel()  # the run is ending: an error of ours from now on is only logged
            drive.cancel()
            await asyncio.wait({drive})
            for task in [*senders, *watching]:
                task.cancel()
            await self.rollouts.abandon()  # none left unless the run failed or was cancelled
            for track in self.tracks:
                if track.workers is not None:
                    track.workers.close()
            self._executor.shutdown(wait=False, cancel_futures=True)
            await self.client.aclose_pool()
            self.report.elapsed_s = time.monotonic() - started  # an interrupted run's too
        return self.report

    async def _drive(self, senders: list[asyncio.Task[None]]) -> None:
        """The run itself: groups as admission allows (or the synchronous loop), evaluation rounds,
        and the wait until every episode is finished and answered."""
        rollouts, g, episodes = self.rollouts, self.config.group_size, self.config.episodes
        config = self.config
        starts = GroupStarts(
            self.tracks,
            self.rollouts,
            self.report,
            self.spool,
            self._stop_requested,
            config,
        )
        ended: set[int] = set()  # the tracks whose order is done (``epochs``)
        groups = 0
        if self.config.eval_only:
            await rollouts.start_eval()
        elif self.config.sync:
            await self._run_sync(senders, starts)
        more = not (self.config.eval_only or self.config.sync)  # whole groups until ``episodes`` have started
        while more and not self._stop.is_set() and (not episodes or self.report.started < episodes):
            if self.config.follow_group_size and self.admission.group_size:
                g = self.admission.group_size
            index = await self._wait_for_admission(g, ended)
            if index is None or self._stop.is_set():
                break
            if rollouts.eval_due():
                await rollouts.start_eval()
            if await starts.next_group(index, str(groups), g):
                groups += 1
            else:
                ended.add(index)
                more = len(ended) < len(self.tracks)
        await rollouts.finish()
        await self.admission.drained(senders)
        if self.config.eval_every and not self._stop.is_set() and rollouts.version != rollouts.last_eval:
            await rollouts.start_eval()  # the policy the run ends with
            await rollouts.finish()
            await self.admission.drained(senders)

    async def _run_sync(
        self,
        senders: list[asyncio.Task[None]],
        starts: GroupStarts,
    ) -> None:
        """The synchronous loop (``RunConfig.sync``): a batch, all of it answered, the step, again."""
        rollouts = self.rollouts
        status = await self.admission.status(self.client.server_url)
        if status is None:
            return
        batch_groups, g = status.learner.batch_groups, status.learner.group_size
        if g != self.config.group_size:
            logger.warning("--sync takes the server's group size (%d), not --group-size %d", g, self.config.group_size)
        per_round = batch_groups * g
        rounds = math.ceil(self.config.episodes / per_round) if self.config.episodes else None
        logger.info("synchronous rounds of %d groups x %d episodes", batch_groups, g)
        while not self._stop.is_set() and (rounds is None or self.report.rounds < rounds):
            await self.admission.spool_room()
            if rollouts.eval_due():
                await rollouts.start_eval()
            trained_before = status.trajectories.trained
            accepted_before = self.report.accepted
            started = [await starts.next_group(0, f"r{self.report.rounds}:{k}", g) for k in range(batch_groups)]
            if not any(started):
                break  # the order has ended (``epochs``)
            await rollouts.finish()
            await self.admission.drained(senders)
            waiting = time.monotonic()
            target = trained_before + (self.report.accepted - accepted_before)
            while not self._stop.is_set():  # the server counts them trained once the step's weights are live
                polled = await self.admission.status(self.client.server_url)
                if polled is None:
                    return
                status = polled
                if status.trajectories.trained >= target:
                    break
                await asyncio.sleep(self.config.poll_interval)
            self.report.waiting_for_learner_s += time.monotonic() - waiting
            self.report.rounds += 1

    def _client_report(self, spool: Spool, sending: int = 0) -> ClientReport:
        """What this run tells a server about itself with each push (the depth of that server's
        spool behind the ``sending`` trajectories of this push)."""
        return ClientReport(
            id=self.client.client_id,
            spool_depth=max(0, spool.depth - sending),
            episodes=self.report.finished,
            running=max(0, self.report.started - self.report.finished),
            code_version=self.code_version,
        )


async def _supervise(drive: asyncio.Task[None], watched: Sequence[asyncio.Future[None]]) -> None:
    """Wait for ``drive``; if one of ``watched`` (the episodes' failure, the senders: none of them ends
    but by failing) fails first, cancel ``drive`` and raise that error, with its own traceback."""
    done, _ = await asyncio.wait({drive, *watched}, return_when=asyncio.FIRST_COMPLETED)
    errors = [f.exception() for f in watched if f in done and not f.cancelled()]
    if drive not in done:
        drive.cancel()
        await asyncio.wait({drive})
    for error in errors:
        if error is not None:
            raise error
    drive.result()
