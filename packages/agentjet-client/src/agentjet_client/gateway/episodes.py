"""Episodes from a finished session: its trajectories, its GRPO group, and the answer to its feedback.

See ``sessions`` for what a session becomes; this module builds it. A session is one trajectory of
every call (the path the user saw) in the group its group key is filling; a single-turn fan-out session
is one trajectory per rewarded candidate, in a group of their own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from agentjet_client.gateway.journal import Finished, Journal, SessionRow
from agentjet_client.protocol import Feedback, FeedbackResult, Trajectory, Turn

GROUP_BY = ("prompt", "header", "session")


class FeedbackError(ValueError):
    """Feedback that cannot be taken: ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Episodes:
    """Builds a finished session's trajectories (``build``) and answers feedback about finished ones."""

    def __init__(
        self,
        journal: Journal,
        gateway_id: str,
        group_size: Callable[[], int],
        labels: dict[str, float],
        group_by: str,
        task_tag: str | None,
    ) -> None:
        self.journal, self.gateway_id = journal, gateway_id
        self.group_size, self.labels, self.group_by, self.task_tag = group_size, labels, group_by, task_tag

    def reward_of(self, feedback: Feedback) -> float:
        if feedback.reward is not None:
            return feedback.reward
        assert feedback.label is not None
        if feedback.label not in self.labels:
            known = ", ".join(f"{k}={v:g}" for k, v in sorted(self.labels.items())) or "none"
            raise FeedbackError(
                400, f"unknown label '{feedback.label}' (known: {known}); map it with --label {feedback.label}=REWARD"
            )
        return self.labels[feedback.label]

    def repeated(self, feedback: Feedback, reward: float) -> FeedbackResult:
        done: Finished | None = self.journal.finished(feedback.session)
        if done is None:
            raise FeedbackError(
                404,
                f"no session '{feedback.session}' on this gateway: give the X-AgentJet-Session (or user) its calls "
                "carried, or the X-AgentJet-Session-Id the gateway answered with",
            )
        if done.outcome == "expired":
            raise FeedbackError(410, f"session '{feedback.session}' expired without a reward (--ttl); it was dropped")
        if done.outcome in ("trained", "fallback") and done.reward != reward:
            raise FeedbackError(
                409,
                f"session '{feedback.session}' already ended with reward {done.reward:g} (its feedback's, or a "
                "judge's with --judge-url); a reward is given once",
            )
        outcome = done.outcome if done.outcome in ("trained", "expired", "opted_out", "fallback") else "trained"
        return FeedbackResult(
            session=done.session,
            outcome=outcome,  # type: ignore[arg-type]
            reward=done.reward,
            trajectories=done.trajectories,
            repeated=True,
        )

    def build(
        self, row: SessionRow, turns: list[Turn], feedback: Feedback, reward: float
    ) -> tuple[list[Trajectory], int, tuple[str, str, int, int] | None]:
        """The session's trajectories, how many fan-out candidates were dropped, and the group it joined."""
        n = row.fanout
        rewards = feedback.candidate_rewards
        if rewards is not None and not n:
            raise FeedbackError(400, "candidate_rewards are for sessions sampled with --fan-out; this one was not")
        if rewards is not None and len(rewards) != n:
            raise FeedbackError(
                400, f"the session's first call had {n} candidates; candidate_rewards has {len(rewards)}"
            )
        path = [turns[0], *turns[n:]] if n else turns  # the calls the user saw
        bad = [k for k in feedback.turn_rewards or {} if not 0 <= k < len(path)]
        if bad:
            raise FeedbackError(400, f"turn_rewards index {bad[0]} is not a call of this session (it made {len(path)})")
        meta: dict[str, Any] = {"session": row.key, "gateway": self.gateway_id}
        if n and len(turns) == n:  # a single-turn fan-out: the candidates are a group of their own
            given = [reward, *(rewards or [])[1:]] if rewards is not None else [reward]
            group_id = f"fanout-{row.id}@{self.gateway_id}"
            made = [
                self._trajectory(
                    f"{row.id}.{k}", group_id, [turns[k]], value, feedback, {**meta, "candidate": k}, len(given)
                )
                for k, value in enumerate(given)
            ]
            return made, n - len(given), None
        dropped = n - 1 if n else 0
        for index, value in (feedback.turn_rewards or {}).items():
            path[index] = path[index].model_copy(update={"reward": value})
        key = row.group_key if self.group_by != "session" else None
        if key is None:
            group_id, group = f"session-{row.id}@{self.gateway_id}", None
            size = 1
        else:
            group_id, members, size = self.journal.next_group(key, max(1, self.group_size()), self.gateway_id)
            group = (key, group_id, members, size)
        return [self._trajectory(row.id, group_id, path, reward, feedback, meta, size)], dropped, group

    def _trajectory(
        self,
        name: str,
        group_id: str,
        turns: list[Turn],
        reward: float,
        feedback: Feedback,
        meta: dict[str, Any],
        group_size: int,
    ) -> Trajectory:
        return Trajectory(
            id=f"{self.gateway_id}:{name}",
            task_id=group_id,
            task_tag=self.task_tag,
            client_id=self.gateway_id,
            turns=turns,
            reward=reward,
            agent_rewards=feedback.agent_rewards,
            metadata={**meta, "task": group_id.split("@")[0], "group_size": group_size},
        )
