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
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

from agentjet_server.observe.metrics import MAX_LABELS, Buckets, Snapshot, Telemetry

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _gauge(name: str, doc: str, value: float | None) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=float("nan") if value is None else float(value))


def _histogram(name: str, doc: str, buckets: Buckets) -> HistogramMetricFamily:
    return HistogramMetricFamily(name, doc, buckets=buckets.cumulative(), sum_value=buckets.sum)


class RuntimeCollector(Collector):
    def __init__(self, telemetry: Telemetry, snapshot: Callable[[], Snapshot]) -> None:
        self.telemetry = telemetry
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap, tel = self.snapshot(), self.telemetry
        counts = snap.counts
        outcomes = CounterMetricFamily(
            "agentjet_trajectories", "Trajectories pushed, by the server's answer", labels=["outcome"]
        )
        for outcome, value in (
            ("accepted", counts.accepted),
            ("evaluated", counts.evaluated),
            ("duplicate", counts.duplicate),
            ("rejected", counts.rejected),
        ):
            outcomes.add_metric([outcome], value)
        yield outcomes
        rejected = CounterMetricFamily(
            "agentjet_trajectories_rejected", "Trajectories rejected, by reason", labels=["reason"]
        )
        for reason, value in sorted(counts.rejected_by_reason.items()):
            rejected.add_metric([reason], value)
        yield rejected
        yield CounterMetricFamily(
            "agentjet_trajectories_trained", "Trajectories taken by the learner", value=counts.trained
        )
        yield _gauge("agentjet_buffer_trajectories", "Trajectories waiting to be trained", counts.buffered)
        groups = GaugeMetricFamily("agentjet_buffer_groups", "GRPO groups waiting, by state", labels=["state"])
        groups.add_metric(["ready"], snap.ready_groups)
        groups.add_metric(["open"], snap.open_groups)
        yield groups
        yield _gauge("agentjet_admission_budget", "Episodes runners are invited to start now", snap.admission_budget)
        tag_episodes = GaugeMetricFamily(
            "agentjet_tag_episodes", "Training episodes by task tag and state (since start)", labels=["tag", "state"]
        )
        budgets = GaugeMetricFamily(
            "agentjet_tag_admission_budget", "Episodes of a tag runners may start now (--mix)", labels=["tag"]
        )
        for tag, info in sorted(snap.by_tag.items())[:MAX_LABELS]:
            for state, value in (("accepted", info.accepted), ("buffered", info.buffered), ("trained", info.trained)):
                tag_episodes.add_metric([tag, state], value)
            if info.admission_budget is not None:
                budgets.add_metric([tag], info.admission_budget)
        yield tag_episodes
        yield budgets
        yield _gauge("agentjet_policy_version", "Version of the weights being served", snap.policy_version)
        yield CounterMetricFamily("agentjet_learner_steps", "Learner steps taken", value=snap.step)
        yield _gauge("agentjet_learner_paused", "1 while learning is paused by the admin API", int(snap.paused))
        yield _gauge("agentjet_checkpoint_step", "Learner step of the newest checkpoint", snap.checkpoint_step)
        yield _gauge(
            "agentjet_checkpoint_uploaded_step",
            "Learner step of the newest checkpoint in the object store",
            snap.uploaded_step,
        )
        yield _gauge(
            "agentjet_remote_log_lag_bytes",
            "Trajectory log bytes not in the object store yet",
            snap.remote_log_lag_bytes,
        )
        yield _gauge("agentjet_uptime_seconds", "Seconds since the server started", snap.uptime_s)

        serving = tel.serving
        yield CounterMetricFamily(
            "agentjet_tokens_sampled", "Completion tokens sampled by the engine", value=serving.completion_tokens
        )
        yield CounterMetricFamily(
            "agentjet_prompt_tokens", "Prompt tokens of engine requests", value=serving.prompt_tokens
        )
        yield CounterMetricFamily(
            "agentjet_engine_requests", "Engine requests (one per choice)", value=serving.requests
        )
        yield _gauge("agentjet_engine_requests_in_flight", "Engine requests generating now", serving.in_flight)
        if snap.replicas:  # --engine-replicas: each replica's share
            per = (
                (GaugeMetricFamily, "agentjet_replica_up", "1 while the engine replica serves", "state"),
                (GaugeMetricFamily, "agentjet_replica_in_flight", "Requests the replica is sampling now", "in_flight"),
                (GaugeMetricFamily, "agentjet_replica_asleep", "1 while the replica sleeps (--engine-sleep)", "asleep"),
                (CounterMetricFamily, "agentjet_replica_requests", "Requests routed to the replica", "requests"),
                (CounterMetricFamily, "agentjet_replica_tokens", "Tokens the replica sampled", "tokens"),
                (
                    CounterMetricFamily,
                    "agentjet_replica_restarts",
                    "Times the replica's process was restarted",
                    "restarts",
                ),
            )
            for kind, name, doc, key in per:
                family = kind(name, doc, labels=["replica"])
                for replica in snap.replicas:
                    value = replica[key] == "ready" if key == "state" else replica[key]
                    family.add_metric([str(replica["index"])], float(value))
                yield family
        yield _histogram(
            "agentjet_engine_time_to_first_token_seconds",
            "Seconds from an engine request to its first token",
            serving.ttft,
        )
        yield _gauge(
            "agentjet_engine_tokens_per_second",
            "Completion tokens sampled per second (last 10 s)",
            tel.tokens_per_second(),
        )

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
        yield CounterMetricFamily("agentjet_tokens_trained", "Sampled tokens trained on", value=tel.trained_tokens)
        steps = CounterMetricFamily(
            "agentjet_learner_steps_by_mode",
            "Learner steps since the server started, by the loss they ran (rl, distill, sft, dpo)",
            labels=["mode"],
        )
        for mode in ("rl", "distill", "sft", "dpo"):
            steps.add_metric([mode], float(tel.steps_by_mode.get(mode, 0)))
        yield steps
        last = tel.last_step
        learner: tuple[tuple[str, str, float | None], ...] = (
            ("agentjet_learner_loss", "Loss of the last step", last.loss if last else None),
            (
                "agentjet_learner_approx_kl",
                "Approximate KL to the behaviour policy, last step",
                _get(last, "approx_kl"),
            ),
            (
                "agentjet_learner_clip_fraction",
                "Fraction of trained tokens clipped, last step",
                _get(last, "clip_fraction"),
            ),
            ("agentjet_learner_entropy_nats", "Policy entropy at trained tokens, last step", _get(last, "entropy")),
            (
                "agentjet_learner_is_weight_mean",
                "Mean truncated importance weight against the behaviour policy, last step",
                _get(last, "is_weight_mean"),
            ),
            (
                "agentjet_learner_is_truncated_fraction",
                "Fraction of trained tokens whose importance weight hit the cap, last step",
                _get(last, "is_truncated_fraction"),
            ),
            ("agentjet_learner_kl_reference", "k3 KL to the reference model, last step", _get(last, "kl_reference")),
            (
                "agentjet_learner_teacher_kl",
                "Distillation: mean reverse KL estimate to the teacher at the sampled tokens, last step",
                _get(last, "teacher_kl"),
            ),
            (
                "agentjet_learner_reward_margin",
                "DPO: beta times the pairs' mean margin over the reference, last preference step",
                _get(last, "reward_margin"),
            ),
            (
                "agentjet_learner_value_error",
                "PPO critic's squared error to returns, last step",
                _get(last, "value_error"),
            ),
            (
                "agentjet_learner_grad_norm",
                "Gradient norm before clipping, last step",
                last.grad_norm if last else None,
            ),
            (
                "agentjet_engine_sleep_seconds",
                "Seconds the engine took to free its memory before the last step (--engine-sleep)",
                last.engine_sleep_seconds if last else None,
            ),
        )
        for name, doc, figure in learner:
            yield _gauge(name, doc, figure)
        yield _histogram("agentjet_learner_step_seconds", "Seconds per learner step", tel.step_seconds)
        yield _histogram(
            "agentjet_weight_update_seconds",
            "Seconds to gather and hand new weights to the engine",
            tel.weight_update_seconds,
        )
        yield _histogram(
            "agentjet_trained_token_version_lag",
            "Policy versions between the weights that sampled a trained token and those it trained",
            tel.lag,
        )

        rewards = tel.rewards()
        by_tag = SummaryMetricFamily(
            "agentjet_episode_reward",
            "Rewards of accepted episodes, by purpose and task tag",
            labels=["purpose", "tag"],
        )
        for row in rewards["by_tag"]:
            by_tag.add_metric([row["purpose"], row["tag"]], row["episodes"], (row["mean"] or 0.0) * row["episodes"])
        yield by_tag
        by_agent = SummaryMetricFamily(
            "agentjet_agent_reward", "Rewards of accepted episodes, by purpose and agent", labels=["purpose", "agent"]
        )
        for row in rewards["by_agent"]:
            by_agent.add_metric([row["purpose"], row["agent"]], row["episodes"], (row["mean"] or 0.0) * row["episodes"])
        yield by_agent

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


def _get(record: Any, name: str) -> float | None:
    return getattr(record, name, None) if record is not None else None


class Exposition:
    """A private registry (several servers in one process don't share metrics) with one collector."""

    def __init__(self, telemetry: Telemetry, snapshot: Callable[[], Snapshot]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(RuntimeCollector(telemetry, snapshot))

    def render(self) -> bytes:
        return generate_latest(self.registry)
