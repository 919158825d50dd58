"""What the server measures, and where it shows: ``GET /metrics`` (the Prometheus text format),
``<state-dir>/metrics.jsonl`` (history: a line per learner step, per evaluation episode, per
configuration change, and one a minute) and the dashboard, which reads both.

One source of truth per figure. Counts the runtime keeps anyway (trajectories accepted, rejected
by reason, trained; the policy version and learner step; the buffer) are read from their owners
when scraped, through the ``Snapshot`` the runtime builds. What nothing else keeps is counted here:
tokens sampled and time to first token (``ServingStats``, plain integers on the serving path, no
Prometheus object is touched while a request is served), rewards per task tag and agent, the
version lag of trained tokens, the learner's per-step figures and what each client reports.

The jsonl history is append-only and survives ``--resume`` (``--fresh`` deletes it with the run);
the newest lines are kept in memory for ``GET /v1/metrics/history`` and the dashboard.

Names follow Prometheus's conventions: ``agentjet_`` prefix, base units in the name (``_seconds``),
``_total`` on counters.
"""

from __future__ import annotations

import bisect
import json
import logging
import math
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from agentjet_client.protocol import ClientInfo, ClientReport, TagInfo, Trajectory, TrajectoryCounts, TrajectoryResult
from agentjet_server.observe.steps import MAX_LABELS, Mean, StepRecord, agent_rewards
from agentjet_server.observe.tasks import TaskTable
from agentjet_server.observe.tool_calls import ToolCallHealth
from agentjet_server.versions import PolicyVersions

logger = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
STEP_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0)
LAG_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64)
MAX_CLIENTS = 1024  # clients remembered (least recently seen forgotten first): bounds label cardinality
HISTORY_LINES = 20_000  # history lines kept in memory for the dashboard
RECENT_EVENTS = 200


class Buckets:
    """A histogram as plain counts: ``observe`` is a bisect and two additions."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, weight: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += weight
        self.sum += value * weight
        self.count += weight

    def cumulative(self) -> list[tuple[str, float]]:
        out, running = [], 0
        for bound, count in zip(self.bounds, self.counts, strict=False):
            running += count
            out.append((_bound(bound), float(running)))
        out.append(("+Inf", float(self.count)))
        return out

    def quantile(self, q: float) -> float | None:
        """The upper bound of the bucket holding quantile ``q`` (None before any observation)."""
        if not self.count:
            return None
        target, running = q * self.count, 0
        for bound, count in zip(self.bounds, self.counts, strict=False):
            running += count
            if running >= target:
                return float(bound)
        return math.inf


def _bound(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


@dataclass
class ServingStats:
    """Counted by the chat service on the event loop; read (without a lock) when scraped."""

    in_flight: int = 0  # engine requests (one per choice) generating now
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft: Buckets = field(default_factory=lambda: Buckets(LATENCY_BUCKETS))


@dataclass
class Snapshot:
    """The runtime's own counts, read together when scraped or logged."""

    uptime_s: float
    policy_version: int
    step: int
    paused: bool
    counts: TrajectoryCounts
    ready_groups: int
    open_groups: int
    admission_budget: int
    checkpoint_step: int | None
    learner_error: str | None
    by_tag: dict[str, TagInfo] = field(default_factory=dict)
    replicas: list[dict[str, Any]] = field(default_factory=list)  # engine replicas (--engine-replicas)
    uploaded_step: int | None = None  # the newest checkpoint in --checkpoint-uri
    remote_log_lag_bytes: int = 0  # log bytes not in --checkpoint-uri yet


class History:
    """``metrics.jsonl``: appended line by line (flushed, not fsynced: a crash may lose the last
    lines, never the run), the newest ``HISTORY_LINES`` also in memory, each with a sequence number
    (``seq``) so a reader can ask for what came after what it has."""

    def __init__(self, path: Path | None, sinks: Sequence[Any] = ()) -> None:
        self.path = path
        self.sinks = list(sinks)  # also given every line (``sinks``: TensorBoard, W&B)
        self._lock = threading.Lock()
        self._lines: deque[dict[str, Any]] = deque(maxlen=HISTORY_LINES)
        self._seq = 0
        self._file = None
        if path is not None:
            if path.exists():
                for line in _tail_lines(path, HISTORY_LINES):
                    self._lines.append(line)
                self._seq = max((int(x.get("seq", 0)) for x in self._lines), default=0)
            try:
                self._file = path.open("a", encoding="utf-8")
            except OSError as exc:  # history is a convenience: the run goes on without it
                logger.warning("cannot write %s (%s); metrics history is kept in memory only", path, exc)

    def append(self, kind: str, **values: Any) -> dict[str, Any]:
        with self._lock:
            self._seq += 1
            line = {"seq": self._seq, "kind": kind, "time": round(time.time(), 3), **values}
            self._lines.append(line)
            if self._file is not None:
                try:
                    self._file.write(json.dumps(line, separators=(",", ":"), allow_nan=False) + "\n")
                    self._file.flush()
                except (OSError, ValueError) as exc:
                    logger.warning("cannot append to %s: %s", self.path, exc)
            for sink in self.sinks:
                try:
                    sink(line)
                except Exception:  # a sink's failure never costs the run
                    logger.exception("metrics sink %s failed", type(sink).__name__)
            return line

    def since(self, seq: int = 0, kinds: set[str] | None = None, limit: int = HISTORY_LINES) -> list[dict[str, Any]]:
        with self._lock:
            lines = [x for x in self._lines if x["seq"] > seq and (kinds is None or x["kind"] in kinds)]
        return lines[-limit:]

    @property
    def last_seq(self) -> int:
        return self._seq

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
            for sink in self.sinks:
                try:
                    sink.close()
                except Exception:
                    logger.exception("closing metrics sink %s failed", type(sink).__name__)
            self.sinks = []


def _tail_lines(path: Path, count: int) -> Iterator[dict[str, Any]]:
    try:
        with path.open("r", encoding="utf-8", errors="replace") as f:
            lines: deque[str] = deque(f, maxlen=count)
    except OSError as exc:
        logger.warning("cannot read %s: %s", path, exc)
        return
    for text in lines:
        try:
            value = json.loads(text)
        except ValueError:
            continue  # a line a crash cut short
        if isinstance(value, dict) and "kind" in value:
            yield value


class Clients:
    """Per-client figures from their pushes, the most recently seen ``MAX_CLIENTS`` of them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._clients: OrderedDict[str, ClientInfo] = OrderedDict()

    def record(
        self, report: ClientReport | None, trajectories: Sequence[Trajectory], results: Sequence[TrajectoryResult]
    ) -> None:
        ids = {report.id} if report is not None else {t.client_id for t in trajectories if t.client_id}
        now = time.time()
        with self._lock:
            for client_id in ids:
                info = self._clients.pop(client_id, None) or ClientInfo(id=client_id, last_seen=now)
                self._clients[client_id] = info
                info.last_seen = now
                info.pushes += 1
                for trajectory, result in zip(trajectories, results, strict=True):
                    if report is None and trajectory.client_id != client_id:
                        continue
                    info.trajectories += 1
                    if result.status == "accepted" and trajectory.purpose == "eval":
                        info.evaluated += 1
                    else:
                        setattr(info, result.status, getattr(info, result.status) + 1)
                if report is not None:
                    info.episodes, info.running = report.episodes, report.running
                    info.spool_depth, info.code_version = report.spool_depth, report.code_version
            while len(self._clients) > MAX_CLIENTS:
                self._clients.popitem(last=False)

    def list(self) -> list[ClientInfo]:
        with self._lock:
            return [c.model_copy() for c in reversed(self._clients.values())]


@dataclass
class Telemetry:
    """Everything measured that no other object keeps, and the history it writes."""

    history: History
    serving: ServingStats = field(default_factory=ServingStats)
    clients: Clients = field(default_factory=Clients)
    last_step: StepRecord | None = None
    step_seconds: Buckets = field(default_factory=lambda: Buckets(STEP_BUCKETS))
    weight_update_seconds: Buckets = field(default_factory=lambda: Buckets(STEP_BUCKETS))
    lag: Buckets = field(default_factory=lambda: Buckets(LAG_BUCKETS))
    trained_tokens: int = 0
    steps_by_mode: Counter[str] = field(default_factory=Counter)
    # (purpose, tag) and (purpose, agent) -> rewards of accepted episodes
    rewards_by_tag: dict[tuple[str, str], Mean] = field(default_factory=dict)
    rewards_by_agent: dict[tuple[str, str], Mean] = field(default_factory=dict)
    recent: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=RECENT_EVENTS))
    tool_calls: ToolCallHealth = field(default_factory=ToolCallHealth)
    tasks: TaskTable = field(default_factory=TaskTable)
    _learner_error: str | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _rate: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=64))

    def __post_init__(self) -> None:
        self.tool_calls.on_warning = lambda message: self.record_event("tool_calls", message)

    # -- recording --------------------------------------------------------------------------------
    def record_batch(
        self, report: ClientReport | None, trajectories: Sequence[Trajectory], results: Sequence[TrajectoryResult]
    ) -> None:
        """A push was answered: rewards of what was accepted, rejections, the client's report."""
        self.clients.record(report, trajectories, results)
        with self._lock:
            for trajectory, result in zip(trajectories, results, strict=True):
                if result.status == "rejected":
                    self.recent.append(
                        {"time": time.time(), "kind": "rejected", "id": trajectory.id, "message": result.reason}
                    )
                if result.status != "accepted":
                    continue
                self.tasks.record(trajectory)
                purpose = trajectory.purpose
                _slot(self.rewards_by_tag, (purpose, trajectory.task_tag or "")).add(trajectory.reward)
                for agent, reward in agent_rewards(trajectory).items():
                    _slot(self.rewards_by_agent, (purpose, agent)).add(reward)
        for trajectory, result in zip(trajectories, results, strict=True):
            if result.status == "accepted" and trajectory.purpose == "eval":
                self.history.append(
                    "eval",
                    id=trajectory.id,
                    task_id=trajectory.task_id,
                    tag=trajectory.task_tag or "",
                    policy_version=trajectory.oldest_version,
                    reward=trajectory.reward,
                    agent_rewards=agent_rewards(trajectory),
                    status=trajectory.status,
                )

    def record_step(self, record: StepRecord, lag: Counter[int], snapshot: Snapshot) -> None:
        with self._lock:
            self.last_step = record
            self.step_seconds.observe(record.step_seconds)
            self.weight_update_seconds.observe(record.weight_update_seconds)
            for versions, tokens in lag.items():
                self.lag.observe(versions, tokens)
            self.trained_tokens += record.trained_tokens
            self.steps_by_mode[record.mode] += 1
        self.history.append("step", **{**self.figures(snapshot), **_finite(asdict(record))})

    def record_event(self, kind: str, message: str) -> None:
        """An error or warning worth showing on the dashboard (learner failures, refused writes)."""
        with self._lock:
            if self.recent and self.recent[-1]["message"] == message:
                self.recent[-1]["repeats"] = self.recent[-1].get("repeats", 1) + 1
                self.recent[-1]["time"] = time.time()
            else:
                self.recent.append({"time": time.time(), "kind": kind, "message": message})

    def tick(self, snapshot: Snapshot) -> None:
        """The once-a-minute history line."""
        self.history.append("tick", **self.figures(snapshot))

    # -- reading ----------------------------------------------------------------------------------
    def tokens_per_second(self) -> float:
        """Completion tokens sampled per second over the last ten seconds or more."""
        now, tokens = time.monotonic(), self.serving.completion_tokens
        with self._lock:
            self._rate.append((now, tokens))
            while len(self._rate) > 2 and now - self._rate[1][0] >= 10.0:
                self._rate.popleft()
            then, before = self._rate[0]
        return (tokens - before) / (now - then) if now - then > 0.5 else 0.0

    def figures(self, snapshot: Snapshot) -> dict[str, Any]:
        """The scalar series of a history line (the same figures ``/metrics`` exports)."""
        counts = snapshot.counts
        serving = self.serving
        if snapshot.learner_error != self._learner_error:  # the learner's errors show among the events
            self._learner_error = snapshot.learner_error
            if snapshot.learner_error:
                self.record_event("learner", snapshot.learner_error)
        return {
            "uptime_s": round(snapshot.uptime_s, 3),
            "policy_version": snapshot.policy_version,
            "step": snapshot.step,
            "paused": snapshot.paused,
            "accepted": counts.accepted,
            "duplicate": counts.duplicate,
            "rejected": counts.rejected,
            "rejected_by_reason": dict(counts.rejected_by_reason),
            "evaluated": counts.evaluated,
            "trained": counts.trained,
            "buffered": counts.buffered,
            "ready_groups": snapshot.ready_groups,
            "open_groups": snapshot.open_groups,
            "tokens_sampled": serving.completion_tokens,
            "tokens_trained": self.trained_tokens,
            "tokens_per_second": round(self.tokens_per_second(), 3),
            "requests_in_flight": serving.in_flight,
            "ttft_p50_s": serving.ttft.quantile(0.5),
            "clients": len(self.clients.list()),
        }

    def rewards(self) -> dict[str, Any]:
        with self._lock:
            return {
                "by_tag": [
                    {"purpose": p, "tag": t, "episodes": m.count, "mean": m.mean}
                    for (p, t), m in sorted(self.rewards_by_tag.items())
                ],
                "by_agent": [
                    {"purpose": p, "agent": a, "episodes": m.count, "mean": m.mean}
                    for (p, a), m in sorted(self.rewards_by_agent.items())
                ],
            }


def _slot(table: dict[tuple[str, str], Mean], key: tuple[str, str]) -> Mean:
    if key not in table and len(table) >= MAX_LABELS:
        key = (key[0], "other")
    return table.setdefault(key, Mean())


def _finite(values: dict[str, Any]) -> dict[str, Any]:
    """JSON has no NaN: a figure that is not a number is left out as null."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, float) and not math.isfinite(value):
            value = None
        elif isinstance(value, dict):
            value = _finite(value)
        out[key] = value
    return out


class Ticker:
    """Writes the once-a-minute history line from a thread of its own."""

    def __init__(self, telemetry: Telemetry, snapshot: Callable[[], Snapshot], interval: float = 60.0) -> None:
        self._telemetry, self._snapshot, self._interval = telemetry, snapshot, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="agentjet-metrics", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._telemetry.tick(self._snapshot())
            except Exception:  # the history must never take the server down
                logger.exception("metrics history tick failed")

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)


class TagFigures:
    """Per task tag, what went into learner steps: episodes, and over the complete ones their count and the
    sums of their rewards and version lags (the learner thread counts, ``/v1/status`` reads)."""

    def __init__(self) -> None:
        self.trained: Counter[str] = Counter()
        self.sums: dict[str, list[float]] = {}  # tag -> [complete episodes, reward sum, lag sum]
        self._lock = threading.Lock()

    def count(self, groups: list[list[Trajectory]], version: PolicyVersions | int) -> None:
        versions = PolicyVersions(version) if isinstance(version, int) else version
        with self._lock:
            for trajectory in (t for group in groups for t in group):
                tag = trajectory.task_tag or ""
                self.trained[tag] += 1
                lag = versions.lag(trajectory)
                if trajectory.status == "complete" and lag is not None:
                    sums = self.sums.setdefault(tag, [0.0, 0.0, 0.0])
                    sums[0] += 1
                    sums[1] += trajectory.reward
                    sums[2] += max(0, lag)

    def figures(self) -> tuple[Counter[str], dict[str, tuple[float, float, float]]]:
        """Copies of the counts and sums."""
        with self._lock:
            return self.trained.copy(), {k: (v[0], v[1], v[2]) for k, v in self.sums.items()}
