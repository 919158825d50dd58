"""AgentJet's status: what ``/v1/status`` tells of the policy, the learner, the buffer and the replicas."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field

from agentjet_client.protocol.base import _Strict

# ---------------------------------------------------------------------------------------------
# AgentJet: status
# ---------------------------------------------------------------------------------------------


class TrajectoryCounts(_Strict):
    accepted: int = 0  # training episodes (evaluation episodes are counted in `evaluated`)
    duplicate: int = 0
    rejected: int = 0
    rejected_by_reason: dict[str, int] = Field(default_factory=dict)
    buffered: int = 0
    aged_out_groups: int = 0  # incomplete GRPO groups trained smaller after --group-timeout
    trained: int = 0  # taken by the learner, batches without a reward signal included
    evaluated: int = 0  # evaluation episodes recorded (never trained)
    # turns of accepted trajectories since this server process started: signature checked, or none sent
    verified_turns: int = 0
    unsigned_turns: int = 0


class LearnerInfo(_Strict):
    algorithm: str
    step: int
    batch_groups: int
    group_size: int
    max_staleness: int
    last_loss: float | None = None
    last_step_seconds: float | None = None
    last_mean_reward: float | None = None
    skipped_batches: int = 0
    last_error: str | None = None
    last_checkpoint_step: int | None = None  # what --resume would continue from
    # with --checkpoint-uri: the newest checkpoint in the object store, the log bytes not there yet, its last error
    last_uploaded_step: int | None = None
    remote_log_lag_bytes: int = 0
    object_store_error: str | None = None
    off_policy: str | None = None  # decoupled | tis | none
    stale_policy: str | None = None  # drop | downweight: an episode past max_staleness when trained
    stale_at_training: int = 0  # episodes that aged past the bound while they waited, left out
    downweighted_tokens: int = 0  # tokens trained with less weight for the same reason
    # trained tokens by how many versions older than the weights they updated ("0", "1", ...; this process)
    trained_token_lag: dict[str, int] = Field(default_factory=dict)
    # batches' worth of episodes runners are invited to run ahead of the learner now: --admission-batches at
    # least, more while the learner waits for complete groups and the lag has room under max_staleness
    admission_window: float | None = None
    policy_loss: str | None = None  # ppo | gspo | cispo | sapo | importance_sampling | dro
    # the last step's sampler-trainer mismatch (pi_old / mu): mismatch_kl, the token and sequence ratio quantiles
    # (mismatch_token_p01 ... mismatch_sequence_p99), mismatch_logprob_corr, and the shares rollout correction masked
    last_mismatch: dict[str, float] = Field(default_factory=dict)


class ContextCounts(_Strict):
    """Requests that named the earlier call they continue (``agentjet.prefix_token_ids``)."""

    prefix_requests: int = 0
    extended: int = 0  # the prefix text starts the rendered prompt: its tokens used as they were
    spliced: int = 0  # an answer re-rendered differently (e.g. tool-call JSON): the sampled tokens used
    mismatch: int = 0  # the history really differed (edited, retried): rendered afresh
    reasoning_dropped: int = 0  # the template leaves out earlier reasoning: rendered afresh, a new timeline
    drift_prevented: int = 0  # re-tokenising would have given other tokens than the model sampled


class TagInfo(_Strict):
    """One task tag's episodes on a server (``@swarm_agent(tag=...)``), since the server started."""

    accepted: int = 0  # training episodes accepted
    buffered: int = 0  # accepted and waiting to be trained
    trained: int = 0  # taken into a learner step
    mean_reward: float | None = None  # of the trained ones
    mean_lag: float | None = None  # policy versions between sampling and training, per trained episode
    share: float | None = None  # its share of admitted episodes under --mix (None: not in the mix)
    admission_budget: int | None = None  # episodes of this tag a runner may start now (under --mix)

    def summary(self) -> str:
        def figure(value: float | None) -> str:
            return "-" if value is None else f"{value:.3f}"

        share = f"share {self.share:.2f} " if self.share is not None else ""
        budget = f"  budget {self.admission_budget}" if self.admission_budget is not None else ""
        return (
            f"{share}trained {self.trained} of {self.accepted} accepted (buffered {self.buffered})  "
            f"reward {figure(self.mean_reward)}  staleness {figure(self.mean_lag)}{budget}"
        )


class ToolCallInfo(_Strict):
    """One agent's answers to requests with tools, and how many opened a call the server could not read."""

    answers: int = 0
    malformed: int = 0
    by_version: dict[str, list[int]] = Field(
        default_factory=dict, description="policy version -> [answers, malformed] (the newest versions)"
    )


class ReplicaInfo(_Strict):
    """One engine replica of a server started with ``--engine-replicas N``."""

    index: int
    device: str
    state: Literal["starting", "ready", "restarting", "stopped"]
    pid: int | None = None
    version: int | None = None  # the policy version of the weights it serves
    in_flight: int = 0  # requests it is sampling now
    requests: int = 0  # requests routed to it since the server started
    tokens: int = 0  # tokens it sampled
    restarts: int = 0  # times its process died and was started again
    failovers: int = 0  # requests that were in flight when it died and went on on another replica
    sleeps: bool = False  # --engine-sleep: it sleeps through every learner step (it shares the learner's device)
    asleep: bool = False  # asleep now: requests go to an awake replica, or wait for the step to end

    def summary(self) -> str:
        state = f"{self.state}, asleep" if self.asleep else self.state
        return (
            f"replica {self.index} ({self.device}, {state}, v{self.version}): in flight {self.in_flight}  "
            f"requests {self.requests}  tokens {self.tokens}"
            + (f"  restarts {self.restarts}  failed over {self.failovers}" if self.restarts or self.failovers else "")
        )


class TaskRate(_Strict):
    """Per task (``/v1/status`` ``tasks``): accepted training episodes, their mean reward, the share solved
    (reward at least 1), and its finished groups, of which how many had all rewards equal."""

    task: str
    episodes: int = 0
    mean_reward: float = 0.0
    solved: float = 0.0
    groups: int = 0
    tied_groups: int = 0


class ServerStatus(_Strict):
    """``GET /v1/status``: what the server is doing, and how many episodes it wants now."""

    model: str
    policy_version: int
    trajectories: TrajectoryCounts
    learner: LearnerInfo
    admission_budget: int = Field(
        description="Episodes a runner may start now so that they land within the staleness bound"
    )
    uptime_s: float
    context: ContextCounts = Field(default_factory=ContextCounts)
    paused: bool = False  # learning paused by the admin API (serving and ingestion go on)
    by_tag: dict[str, TagInfo] = Field(default_factory=dict, description="per task tag ('' for untagged)")
    replicas: list[ReplicaInfo] = Field(default_factory=list, description="engine replicas (--engine-replicas > 1)")
    run_id: str | None = Field(
        default=None, description="names the server's run: kept by --resume, new after --fresh or a new state dir"
    )
    tool_calls: dict[str, ToolCallInfo] = Field(
        default_factory=dict, description="per agent: answers to requests with tools, and malformed calls among them"
    )
    serve_only: bool = Field(default=False, description="started with --serve-only: serves, never trains")
    tasks: list[TaskRate] = Field(default_factory=list, description="per task, the most recently trained first")
    adapters: dict[str, int] = Field(
        default_factory=dict, description="an adapter per agent (--adapters): each adapter's own policy version"
    )

    def budget_for(self, tag: str | None) -> int:
        """Episodes of task ``tag`` a runner may start now: the tag's own budget under ``--mix``,
        else the server's."""
        info = self.by_tag.get(tag or "")
        if info is not None and info.admission_budget is not None:
            return info.admission_budget
        return self.admission_budget

    def _mismatch(self) -> str:
        """The last step's sampler-trainer mismatch, where it was measured."""
        m = self.learner.last_mismatch
        if "mismatch_kl" not in m:
            return ""
        low, high = m.get("mismatch_token_p01", math.nan), m.get("mismatch_token_p99", math.nan)
        masked = m.get("token_masked", 0.0) + m.get("sequence_masked", 0.0)
        return f"\n  sampler vs trainer: KL {m['mismatch_kl']:.2g}  pi_old/mu p1-p99 {low:.3f}-{high:.3f}" + (
            f"  masked {masked:.1%}" if masked else ""
        )

    def summary(self) -> str:
        """One line for people: what ``agentjet-server status`` and ``agentjet-client status`` print."""
        t = self.trajectories
        reasons = f" {t.rejected_by_reason}" if t.rejected_by_reason else ""
        return (
            f"model {self.model}  policy v{self.policy_version}  step {self.learner.step}  "
            + (f"reward {self.learner.last_mean_reward:.3f}  " if self.learner.last_mean_reward is not None else "")
            + f"accepted {t.accepted}  duplicate {t.duplicate}  rejected {t.rejected}{reasons}  "
            f"buffered {t.buffered}  trained {t.trained}  turns verified {t.verified_turns}"
            + (f" (unsigned {t.unsigned_turns})" if t.unsigned_turns else "")
            + f"  admission budget {self.admission_budget}"
            + ("  LEARNING PAUSED" if self.paused else "")
            + (
                f"  checkpoint step {self.learner.last_checkpoint_step}"
                if self.learner.last_checkpoint_step is not None
                else ""
            )
            + self._mismatch()
            + "".join(  # task tags, where there are any (a server of untagged episodes has just '')
                f"\n  tag {tag or '(none)'}: {info.summary()}"
                for tag, info in sorted(self.by_tag.items())
                if set(self.by_tag) != {""}
            )
            + "".join(f"\n  {replica.summary()}" for replica in self.replicas)
        )
