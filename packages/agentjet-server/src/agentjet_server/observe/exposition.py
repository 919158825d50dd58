"""``GET /metrics``: the runtime's figures in the Prometheus text format, built with
prometheus-client when scraped (nothing here runs while requests are served).

Every family is read from its owner at scrape time (``metrics.Snapshot`` for the runtime's counts,
``metrics.Telemetry`` for the rest), so ``/metrics``, ``/v1/status`` and ``metrics.jsonl`` never
disagree. Counters restart from the log's counts after ``--resume`` (accepted, rejected, trained are
durable); those only this process counts (tokens sampled, time to first token) start from zero, as
Prometheus expects of a restarted target.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

from agentjet_server.observe.metrics import Buckets, Snapshot, Telemetry
from agentjet_server.observe.steps import MAX_LABELS

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _gauge(name: str, doc: str, value: float | None) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=float("nan") if value is None else float(value))


def _histogram(name: str, doc: str, buckets: Buckets) -> HistogramMetricFamily:
    return HistogramMetricFamily(name, doc, buckets=buckets.cumulative(), sum_value=buckets.sum)


Figure = Callable[[Snapshot, Telemetry], "float | None"]

# one-value families: (counter or gauge, name, help, the value from the snapshot and the telemetry)
SCALARS: tuple[tuple[str, str, str, Figure], ...] = (
    ("counter", "agentjet_trajectories_trained", "Trajectories taken by the learner", lambda s, t: s.counts.trained),
    ("gauge", "agentjet_buffer_trajectories", "Trajectories waiting to be trained", lambda s, t: s.counts.buffered),
    (
        "gauge",
        "agentjet_admission_budget",
        "Episodes runners are invited to start now",
        lambda s, t: s.admission_budget,
    ),
    ("gauge", "agentjet_policy_version", "Version of the weights being served", lambda s, t: s.policy_version),
    ("counter", "agentjet_learner_steps", "Learner steps taken", lambda s, t: s.step),
    ("gauge", "agentjet_learner_paused", "1 while learning is paused by the admin API", lambda s, t: int(s.paused)),
    ("gauge", "agentjet_checkpoint_step", "Learner step of the newest checkpoint", lambda s, t: s.checkpoint_step),
    (
        "gauge",
        "agentjet_checkpoint_uploaded_step",
        "Learner step of the newest checkpoint in the object store",
        lambda s, t: s.uploaded_step,
    ),
    (
        "gauge",
        "agentjet_remote_log_lag_bytes",
        "Trajectory log bytes not in the object store yet",
        lambda s, t: s.remote_log_lag_bytes,
    ),
    ("gauge", "agentjet_uptime_seconds", "Seconds since the server started", lambda s, t: s.uptime_s),
    (
        "counter",
        "agentjet_tokens_sampled",
        "Completion tokens sampled by the engine",
        lambda s, t: t.serving.completion_tokens,
    ),
    ("counter", "agentjet_prompt_tokens", "Prompt tokens of engine requests", lambda s, t: t.serving.prompt_tokens),
    ("counter", "agentjet_engine_requests", "Engine requests (one per choice)", lambda s, t: t.serving.requests),
    (
        "gauge",
        "agentjet_engine_requests_in_flight",
        "Engine requests generating now",
        lambda s, t: t.serving.in_flight,
    ),
    (
        "gauge",
        "agentjet_engine_tokens_per_second",
        "Completion tokens sampled per second (last 10 s)",
        lambda s, t: t.tokens_per_second(),
    ),
    ("counter", "agentjet_tokens_trained", "Sampled tokens trained on", lambda s, t: t.trained_tokens),
)
# the last step's figures, as gauges: (name, help, the step record's field)
LAST_STEP = (
    ("agentjet_learner_loss", "Loss of the last step", "loss"),
    ("agentjet_learner_approx_kl", "Approximate KL to the behaviour policy, last step", "approx_kl"),
    ("agentjet_learner_clip_fraction", "Fraction of trained tokens clipped, last step", "clip_fraction"),
    ("agentjet_learner_entropy_nats", "Policy entropy at trained tokens, last step", "entropy"),
    (
        "agentjet_learner_is_weight_mean",
        "Mean truncated importance weight against the behaviour policy, last step",
        "is_weight_mean",
    ),
    (
        "agentjet_learner_is_truncated_fraction",
        "Fraction of trained tokens whose importance weight hit the cap, last step",
        "is_truncated_fraction",
    ),
    ("agentjet_learner_kl_reference", "k3 KL to the reference model, last step", "kl_reference"),
    (
        "agentjet_learner_mismatch_kl",
        "k3 KL from the sampler's log-probs to the trainer's (mu to pi_old) at trained tokens, last step",
        "mismatch_kl",
    ),
    ("agentjet_learner_mismatch_token_ratio_p01", "1st percentile of pi_old / mu per token", "mismatch_token_p01"),
    ("agentjet_learner_mismatch_token_ratio_p50", "Median of pi_old / mu per token, last step", "mismatch_token_p50"),
    ("agentjet_learner_mismatch_token_ratio_p99", "99th percentile of pi_old / mu per token", "mismatch_token_p99"),
    (
        "agentjet_learner_mismatch_sequence_ratio_p01",
        "1st percentile of each sequence's geometric-mean pi_old / mu, last step",
        "mismatch_sequence_p01",
    ),
    (
        "agentjet_learner_mismatch_sequence_ratio_p99",
        "99th percentile of each sequence's geometric-mean pi_old / mu, last step",
        "mismatch_sequence_p99",
    ),
    (
        "agentjet_learner_mismatch_logprob_corr",
        "Correlation of the trainer's and the sampler's log-probs of the trained tokens, last step",
        "mismatch_logprob_corr",
    ),
    ("agentjet_learner_token_masked_fraction", "Trained tokens left out by --token-mask, last step", "token_masked"),
    (
        "agentjet_learner_sequence_masked_fraction",
        "Trained tokens left out by --sequence-mask (in masked sequences), last step",
        "sequence_masked",
    ),
    (
        "agentjet_learner_teacher_kl",
        "Distillation: mean reverse KL estimate to the teacher at the sampled tokens, last step",
        "teacher_kl",
    ),
    (
        "agentjet_learner_reward_margin",
        "DPO: beta times the pairs' mean margin over the reference, last preference step",
        "reward_margin",
    ),
    ("agentjet_learner_value_error", "PPO critic's squared error to returns, last step", "value_error"),
    ("agentjet_learner_grad_norm", "Gradient norm before clipping, last step", "grad_norm"),
    (
        "agentjet_engine_sleep_seconds",
        "Seconds the engine took to free its memory before the last step (--engine-sleep)",
        "engine_sleep_seconds",
    ),
)
# histograms: (name, help, the telemetry's buckets)
HISTOGRAMS: tuple[tuple[str, str, Callable[[Telemetry], Buckets]], ...] = (
    (
        "agentjet_engine_time_to_first_token_seconds",
        "Seconds from an engine request to its first token",
        lambda t: t.serving.ttft,
    ),
    ("agentjet_learner_step_seconds", "Seconds per learner step", lambda t: t.step_seconds),
    (
        "agentjet_weight_update_seconds",
        "Seconds to gather and hand new weights to the engine",
        lambda t: t.weight_update_seconds,
    ),
    (
        "agentjet_trained_token_version_lag",
        "Policy versions between the weights that sampled a trained token and those it trained",
        lambda t: t.lag,
    ),
)
# each engine replica's share (--engine-replicas): (kind, name, help, the replica's field)
PER_REPLICA = (
    (GaugeMetricFamily, "agentjet_replica_up", "1 while the engine replica serves", "state"),
    (GaugeMetricFamily, "agentjet_replica_in_flight", "Requests the replica is sampling now", "in_flight"),
    (GaugeMetricFamily, "agentjet_replica_asleep", "1 while the replica sleeps (--engine-sleep)", "asleep"),
    (CounterMetricFamily, "agentjet_replica_requests", "Requests routed to the replica", "requests"),
    (CounterMetricFamily, "agentjet_replica_tokens", "Tokens the replica sampled", "tokens"),
    (CounterMetricFamily, "agentjet_replica_restarts", "Times the replica's process was restarted", "restarts"),
)


class RuntimeCollector(Collector):
    def __init__(self, telemetry: Telemetry, snapshot: Callable[[], Snapshot]) -> None:
        self.telemetry = telemetry
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap, tel = self.snapshot(), self.telemetry
        for kind, name, doc, figure in SCALARS:
            value = figure(snap, tel)
            yield _gauge(name, doc, value) if kind == "gauge" else CounterMetricFamily(name, doc, value=value)
        last = tel.last_step
        for name, doc, key in LAST_STEP:
            yield _gauge(name, doc, getattr(last, key, None) if last is not None else None)
        for name, doc, buckets in HISTOGRAMS:
            yield _histogram(name, doc, buckets(tel))
        yield from _trajectories(snap)
        yield from _replicas(snap)
        yield from _tool_calls_and_modes(tel)
        yield from _rewards(tel)
        yield from _clients(tel)


def _trajectories(snap: Snapshot) -> Iterator[Metric]:
    counts = snap.counts
    outcomes = CounterMetricFamily(
        "agentjet_trajectories", "Trajectories pushed, by the server's answer", labels=["outcome"]
    )
    for outcome in ("accepted", "evaluated", "duplicate", "rejected"):
        outcomes.add_metric([outcome], getattr(counts, outcome))
    yield outcomes
    rejected = CounterMetricFamily(
        "agentjet_trajectories_rejected", "Trajectories rejected, by reason", labels=["reason"]
    )
    for reason, value in sorted(counts.rejected_by_reason.items()):
        rejected.add_metric([reason], value)
    yield rejected
    groups = GaugeMetricFamily("agentjet_buffer_groups", "GRPO groups waiting, by state", labels=["state"])
    groups.add_metric(["ready"], snap.ready_groups)
    groups.add_metric(["open"], snap.open_groups)
    yield groups
    tag_episodes = GaugeMetricFamily(
        "agentjet_tag_episodes", "Training episodes by task tag and state (since start)", labels=["tag", "state"]
    )
    budgets = GaugeMetricFamily(
        "agentjet_tag_admission_budget", "Episodes of a tag runners may start now (--mix)", labels=["tag"]
    )
    for tag, info in sorted(snap.by_tag.items())[:MAX_LABELS]:
        for state in ("accepted", "buffered", "trained"):
            tag_episodes.add_metric([tag, state], getattr(info, state))
        if info.admission_budget is not None:
            budgets.add_metric([tag], info.admission_budget)
    yield tag_episodes
    yield budgets


def _replicas(snap: Snapshot) -> Iterator[Metric]:
    if not snap.replicas:
        return
    for kind, name, doc, key in PER_REPLICA:
        family = kind(name, doc, labels=["replica"])
        for replica in snap.replicas:
            value = replica[key] == "ready" if key == "state" else replica[key]
            family.add_metric([str(replica["index"])], float(value))
        yield family


def _tool_calls_and_modes(tel: Telemetry) -> Iterator[Metric]:
    tool_calls = tel.tool_calls.status()
    if tool_calls:
        for name, doc, key in (
            ("agentjet_tool_call_answers", "Answers to requests with tools, per agent", "answers"),
            ("agentjet_tool_calls_malformed", "Answers opening a tool call the server could not read", "malformed"),
        ):
            family = CounterMetricFamily(name, doc, labels=["agent"])
            for agent, health in tool_calls.items():
                family.add_metric([agent], float(getattr(health, key)))
            yield family
    steps = CounterMetricFamily(
        "agentjet_learner_steps_by_mode",
        "Learner steps since the server started, by the loss they ran (rl, distill, sft, dpo)",
        labels=["mode"],
    )
    for mode in ("rl", "distill", "sft", "dpo"):
        steps.add_metric([mode], float(tel.steps_by_mode.get(mode, 0)))
    yield steps


def _rewards(tel: Telemetry) -> Iterator[Metric]:
    rewards = tel.rewards()
    for key, label, name, doc in (
        ("by_tag", "tag", "agentjet_episode_reward", "Rewards of accepted episodes, by purpose and task tag"),
        ("by_agent", "agent", "agentjet_agent_reward", "Rewards of accepted episodes, by purpose and agent"),
    ):
        family = SummaryMetricFamily(name, doc, labels=["purpose", label])
        for row in rewards[key]:
            family.add_metric([row["purpose"], row[label]], row["episodes"], (row["mean"] or 0.0) * row["episodes"])
        yield family


def _clients(tel: Telemetry) -> Iterator[Metric]:
    seen = GaugeMetricFamily(
        "agentjet_client_last_seen_timestamp_seconds", "Unix time of each client's last push", labels=["client"]
    )
    episodes = CounterMetricFamily(
        "agentjet_client_episodes", "Episodes each client reports finished", labels=["client"]
    )
    spool = GaugeMetricFamily(
        "agentjet_client_spool_depth", "Trajectories waiting in each client's spool", labels=["client"]
    )
    for client in tel.clients.list():
        seen.add_metric([client.id], client.last_seen)
        episodes.add_metric([client.id], client.episodes)
        spool.add_metric([client.id], client.spool_depth)
    yield seen
    yield episodes
    yield spool


class Exposition:
    """A private registry (several servers in one process don't share metrics) with one collector."""

    def __init__(self, telemetry: Telemetry, snapshot: Callable[[], Snapshot]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(RuntimeCollector(telemetry, snapshot))

    def render(self) -> bytes:
        return generate_latest(self.registry)
