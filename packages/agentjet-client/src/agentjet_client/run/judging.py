"""The judging stage: episodes whose reward an LLM judge gives wait in the spool until it has.

An episode of an agent with ``reward=Judge(...)`` or ``GroupJudge(...)`` is spooled as soon as it ends,
marked as waiting (``spool.WAITING``: the task, the agent's result, its group's size), so a crash or a
judge that is down loses nothing. Senders skip waiting items. This stage reads them from the spool of
the run's first server, and

- for a ``GroupJudge``: once every episode of a group is there (or the group has waited
  ``judge.group_timeout`` seconds), scores the group's complete episodes in one call;
- for a ``Judge``: scores each episode on its own.

The answer is kept in the spool under a key of the judge and of what it judged, before any item is
released, so judging the same group again (after a crash, or the same results again) makes no call.
Then each server's part of every episode gets the reward (``reward_components`` ``{"judge": score}``;
what the judge said in ``metadata["judge"]``), is released to its sender and counted in the run's
report. A judge that fails (down, or an answer without scores) leaves the group waiting; it is tried
again with backoff, and the episodes it holds hold new ones back once the spool's bound is reached.
A judge whose answers hold no scores ``judge.max_unparsed`` times in a row cannot judge: the stage
fails with ``JudgeUnfit``, which ends the run (its episodes stay in the spool). The same failure
again is logged once a minute, with how often it happened meanwhile, not once per group.
Failed episodes are not shown to the judge; they are released with their group, unrewarded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from agentjet_client.delivery.spool import WAITING, Spool
from agentjet_client.protocol import Trajectory
from agentjet_client.run.report import RunReport
from agentjet_client.tasks.judges import Judge, JudgeError, JudgeUnfit, Verdict

logger = logging.getLogger(__name__)
QUIET_S = 60.0  # the same judge failure is logged again after this long (with its count meanwhile)


def _plain(value: Any) -> Any:
    """``value`` as JSON data (what a trajectory's metadata can hold)."""
    return json.loads(json.dumps(value, ensure_ascii=False, default=str))


def waiting_for(judge: Judge, task: Any, result: Any, group_size: int, evaluation: int | None) -> dict[str, Any]:
    """What a waiting episode keeps for its judge (``metadata[WAITING]``)."""
    return {
        "judge": judge.fingerprint,
        "task": _plain(task),
        "result": _plain(result),
        "group_size": 1 if evaluation is not None else group_size,
        "evaluation": evaluation,
    }


class JudgingStage:
    """Judges the episodes waiting in the spools of a run (see the module docstring)."""

    def __init__(
        self,
        judge: Judge,
        spools: dict[str, Spool],
        default: str,
        report: RunReport,
        released: Callable[[], None],
        *,
        claims: Callable[[str], bool] | None = None,
        retry: tuple[float, float] = (1.0, 30.0),
    ) -> None:
        self.judge, self.spools, self.default, self.report = judge, spools, default, report
        # which waiting episodes are this stage's, by the fingerprint of the judge they wait for
        self._claims = claims or (lambda fingerprint: True)
        self._released = released
        self._wake = asyncio.Event()
        self._busy: set[str] = set()  # groups being judged now
        self._retry_at: dict[str, tuple[float, float]] = {}  # group -> (not before, next pause)
        self._retry = retry
        self._unparsed = 0  # answers in a row without usable scores
        self._unfit: JudgeUnfit | None = None  # set once the judge is found unable to judge: the run stops
        self._logged: tuple[str, float, int] = ("", 0.0, 0)  # the last failure logged, when, repeats since

    def wake(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        """Judge what is ready, until cancelled."""
        self._wake = asyncio.Event()  # of the running loop
        jobs: set[asyncio.Task[None]] = set()
        try:
            while True:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=1.0)
                self._wake.clear()
                if self._unfit is not None:
                    raise self._unfit
                for key, members in await asyncio.to_thread(self._ready):
                    self._busy.add(key)
                    job = asyncio.create_task(self._judge(key, members))
                    jobs.add(job)
                    job.add_done_callback(jobs.discard)
        finally:
            for job in jobs:
                job.cancel()
            await asyncio.gather(*jobs, return_exceptions=True)
            await self.judge.aclose()

    def _ready(self) -> list[tuple[str, list[Trajectory]]]:
        """The groups (or, for a per-episode judge, the episodes) that can be judged now."""
        groups: dict[str, list[tuple[Trajectory, float]]] = {}
        for trajectory, added in self.spools[self.default].waiting():
            if not self._claims(str(trajectory.metadata[WAITING].get("judge"))):
                continue
            # an evaluation episode is judged alone: its score measures the policy, not a rank in a group
            alone = not self.judge.group or trajectory.purpose == "eval"
            key = trajectory.id if alone else trajectory.task_id
            groups.setdefault(key, []).append((trajectory, added))
        now, ready = time.time(), []
        for key, members in groups.items():
            if key in self._busy or self._retry_at.get(key, (0.0, 0.0))[0] > time.monotonic():
                continue
            size = members[0][0].metadata[WAITING].get("group_size", 1)
            oldest = min(added for _, added in members)
            if len(members) >= size or key == members[0][0].id or now - oldest > self.judge.group_timeout:
                ready.append((key, sorted((t for t, _ in members), key=lambda t: t.id)))
        return ready

    async def _judge(self, key: str, members: list[Trajectory]) -> None:
        try:
            scores = await self._scores(members)
            self._retry_at.pop(key, None)
            await asyncio.to_thread(self._release, members, scores)
        except JudgeError as exc:
            self._failed(key, exc)
            return
        finally:
            self._busy.discard(key)  # after the release: never judged twice
        self._released()

    def _failed(self, key: str, exc: JudgeError) -> None:
        """Count a failed call (and what it cost), retry its group later; stop at an unfit judge."""
        counts = self.report.judging
        counts["unparsed" if exc.unparsed else "errors"] += 1  # answered without scores, or not answered
        if exc.cost is not None:
            counts["calls"] += 1 if exc.unparsed else 0
            counts["prompt_tokens"] += exc.cost.prompt_tokens
            counts["completion_tokens"] += exc.cost.completion_tokens
            counts["milliseconds"] += round(exc.cost.seconds * 1000)
        self._unparsed = self._unparsed + 1 if exc.unparsed else 0
        if self._unparsed >= self.judge.max_unparsed and self._unfit is None:
            self._unfit = JudgeUnfit(
                f"{exc}; {self._unparsed} answers in a row held no scores, so this model cannot judge: use one "
                'that replies with the JSON object {"scores": [...]} as told (docs/judges.md: which models can '
                "judge; no embedded model can). The episodes it did not judge wait in the spool for the next run"
            )
            self._wake.set()
            return
        _, pause = self._retry_at.get(key, (0.0, self._retry[0]))
        self._retry_at[key] = (time.monotonic() + pause, min(pause * 2, self._retry[1]))
        reason = "no scores in its answer" if exc.unparsed else str(exc)  # answers differ; the failure does not
        last, when, repeats = self._logged
        now = time.monotonic()
        if reason == last and now - when < QUIET_S:
            self._logged = (last, when, repeats + 1)
            return
        again = f" (and {repeats} times more since it was last said)" if reason == last and repeats else ""
        logger.warning("%s%s; the episodes wait in the spool and are judged again in %.0fs", exc, again, pause)
        self._logged = (reason, now, 0)

    async def _scores(self, members: list[Trajectory]) -> dict[str, tuple[float, dict[str, Any]]]:
        """Each complete member's score and what the judge said (from the kept answer if there is one)."""
        complete = [m for m in members if m.status == "complete"]
        if not complete:
            return {}
        task = complete[0].metadata[WAITING]["task"]
        results = [m.metadata[WAITING]["result"] for m in complete]
        cache_key = self.judge.key(task, results)
        kept = await asyncio.to_thread(self.spools[self.default].judged, cache_key) if self.judge.cache else None
        if kept is not None:
            verdict, cached = Verdict(**json.loads(kept)), True
            self.report.judging["cached"] += 1
        else:
            verdict, cached = await self.judge.judge(task, results), False
            self._unparsed = 0
            await asyncio.to_thread(self.spools[self.default].keep_judged, cache_key, json.dumps(asdict(verdict)))
            counts = self.report.judging
            counts["calls"] += 1
            counts["prompt_tokens"] += verdict.prompt_tokens
            counts["completion_tokens"] += verdict.completion_tokens
            counts["milliseconds"] += round(verdict.seconds * 1000)
        said = {
            "model": self.judge.model,
            "kind": "group" if self.judge.group else "episode",
            "candidates": len(complete),
            "cached": cached,
            "explanation": verdict.explanation,
        }
        return {m.id: (score, {**said, "score": score}) for m, score in zip(complete, verdict.scores, strict=True)}

    def _release(self, members: list[Trajectory], scores: dict[str, tuple[float, dict[str, Any]]]) -> None:
        """Every server's part of each member, rewarded, released to its sender; rewards into the report."""
        ids = [m.id for m in members]
        for spool in self.spools.values():
            judged = []
            for trajectory, _ in spool.waiting(ids):
                metadata = {k: v for k, v in trajectory.metadata.items() if k != WAITING}
                update: dict[str, Any] = {"metadata": metadata}
                if trajectory.id in scores:
                    score, said = scores[trajectory.id]
                    update["reward"] = score
                    metadata.update(reward_components={"judge": score}, judge=said)
                judged.append(trajectory.model_copy(update=update))
            spool.release(judged)
        for member in members:
            if member.id in scores:
                evaluation = member.metadata[WAITING].get("evaluation")
                self.report.record_reward(member.model_copy(update={"reward": scores[member.id][0]}), evaluation)


def judging_stages(
    judges: list[Judge], spools: dict[str, Spool], default: str, report: RunReport, released: Callable[[], None]
) -> list[JudgingStage]:
    """One stage per distinct judge of a run's agents; each takes the episodes waiting for its judge, the
    first also those waiting for a judge this run does not have (one whose prompt or model changed)."""
    unique = {judge.fingerprint: judge for judge in judges}

    def claims(mine: str, first: bool) -> Callable[[str], bool]:
        return lambda mark: mark == mine or (first and mark not in unique)

    return [
        JudgingStage(judge, spools, default, report, released, claims=claims(mark, i == 0))
        for i, (mark, judge) in enumerate(unique.items())
    ]


def wake_all(stages: list[JudgingStage]) -> None:
    """An episode was spooled to wait for its judge: every stage looks."""
    for stage in stages:
        stage.wake()
