"""Ingestion of trajectories: idempotency, staleness, validation against the model, durability, counts.

``TrajectoryStore.admit_batch`` decides for each pushed trajectory: ``duplicate`` if its id was seen
before (it is not trained again), ``rejected`` with a reason if it is stale or does not fit the
model, else ``accepted`` (an evaluation episode, ``purpose="eval"``, is recorded but never buffered
for training, and is not held to the staleness bound). With a ``TrajectoryLog`` the decisions are
on disk (fsynced) before the call returns, i.e. before the client is answered; only then do
accepted trajectories reach the group buffer; with a mirrored log (``--checkpoint-uri``), also in the
object store. The set of seen ids and the counts come back from the log after a restart.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable

from agentjet_client.protocol import Trajectory, TrajectoryCounts, TrajectoryResult
from agentjet_server.batching.buffer import footprint
from agentjet_server.ingest.signing import SampleSigner
from agentjet_server.ingest.wal import Accepted, Configured, Evaluated, Published, Record, Rejected, TrajectoryLog
from agentjet_server.versions import PolicyVersions


class TrajectoryStore:
    def __init__(
        self,
        vocab_size: int,
        max_staleness: int,
        sink: Callable[[Trajectory, int], None],
        log: TrajectoryLog | None = None,
        signer: SampleSigner | None = None,
        require_signed: bool = False,
        room: Callable[[int, int], None] | None = None,
        absent: Callable[[str], None] | None = None,
    ) -> None:
        # ``absent(task_id)``: a training trajectory of that group was rejected and will never
        # arrive, so its group must not wait for it (``GroupBuffer.add_absent``)
        # ``room(count, bytes)`` raises (RateLimitError) when the buffer can't take that many more
        self._room = room or (lambda count, size: None)
        self.vocab_size = vocab_size
        self.signer = signer
        self.require_signed = require_signed and signer is not None
        self._signatures: set[str] = set()  # of every accepted turn: a sample is trained once
        self.verified_turns = 0  # since this process started
        self.unsigned_turns = 0
        self.max_staleness = max_staleness
        self._sink = sink
        self._absent = absent or (lambda task_id: None)
        self.log = log
        self._lock = threading.Lock()
        self._seen: set[str] = set()
        self.accepted = 0
        self.accepted_by_tag: Counter[str] = Counter()  # training episodes by task tag, since this process started
        self.evaluated = 0
        self.duplicate = 0
        self.rejected: Counter[str] = Counter()
        self.trained = 0
        self.next_lsn = 0
        # the highest policy version an earlier run of this server published: after a resume, a
        # trajectory sampled by it is not from the future, the learner is only catching up
        self.known_version = 0
        self.known_adapters: dict[str, int] = {}  # the same, per adapter (an adapter per agent)
        if log is not None:
            scan = log.scan
            self._seen = set(scan.seen)
            self.accepted = scan.accepted
            self.evaluated = scan.evaluated
            self.rejected = Counter(scan.rejected)
            self.next_lsn = scan.next_lsn
            self.known_version = scan.max_version
            self.known_adapters = dict(scan.max_adapter_versions)
            self._signatures = set(scan.signatures)

    def _problem(self, trajectory: Trajectory, versions: PolicyVersions) -> tuple[str, str] | None:
        """``(reason code, message)`` if the trajectory cannot be trained."""
        for i, turn in enumerate(trajectory.turns):
            if not versions.knows(turn.adapter):
                named = f"was sampled by adapter {turn.adapter!r}" if turn.adapter else "names no adapter"
                return "unknown_adapter", (
                    f"turn {i} {named}, and this server trains "
                    + (f"the adapters {', '.join(versions.adapters)}" if versions.adapters else "no adapters")
                    + "; push turns exactly as captured from this server's responses"
                )
            served = versions.of(turn.adapter)
            known = self.known_version if turn.adapter is None else self.known_adapters.get(turn.adapter, 0)
            if turn.oldest_version > max(served, known):
                whose = "policy version" if turn.adapter is None else f"version of adapter {turn.adapter!r}"
                return "future_version", (
                    f"a turn claims {whose} {turn.oldest_version} but the server is at {served}; "
                    "send versions exactly as the server returned them"
                )
        lag = versions.lag(trajectory)
        if lag is not None and lag > self.max_staleness and trajectory.purpose == "train":
            if versions.adapters:
                when = f"{lag} versions of its adapter ago"
            else:
                when = f"at policy version {trajectory.oldest_version}, the server is at {versions.current}"
            return "stale", (
                f"stale: its oldest turn was sampled {when} and max_staleness is {self.max_staleness}; start fewer "
                "episodes ahead of training (see admission_budget in /v1/status)"
            )
        for i, turn in enumerate(trajectory.turns):
            bad = [t for t in (*turn.prompt_token_ids, *turn.completion_token_ids) if t >= self.vocab_size]
            if bad:
                return "invalid_tokens", (
                    f"turn {i} has token id {bad[0]} but the model's vocabulary has {self.vocab_size} "
                    "tokens; trajectories must carry the token ids the server returned"
                )
        return None

    def _not_sampled(self, trajectory: Trajectory) -> tuple[str, str] | None:
        """``(reason code, message)`` if a signed turn is not what this server sampled."""
        if self.signer is None:
            return None
        for i, turn in enumerate(trajectory.turns):
            if self.signer.verify_turn(turn) is False:
                return "not_sampled", (
                    f"turn {i} carries a signature, but its token ids, log-probs or versions are not what "
                    "this server sampled (or another server, or a run discarded with --fresh, signed it); "
                    "push turns exactly as captured from this server's responses"
                )
        return None

    def _not_trainable_sample(self, trajectory: Trajectory, batch: set[str]) -> tuple[str, str] | None:
        """``(reason code, message)`` if a turn is unsigned where signatures are required, or was
        trained before (its signature accepted in another trajectory, or twice in this one)."""
        seen: set[str] = set()
        for i, turn in enumerate(trajectory.turns):
            if turn.signature is None:
                if self.require_signed:
                    return "unsigned", (
                        f"turn {i} carries no signature, and this server trains only signed turns "
                        "(--require-signed); push turns exactly as captured from its responses"
                    )
                continue
            if turn.signature in self._signatures or turn.signature in batch or turn.signature in seen:
                return "replayed", (
                    f"turn {i} is a sample that was already pushed in an accepted trajectory; each sampled "
                    "completion is trained once. Push each episode once, under one id"
                )
            seen.add(turn.signature)
        return None

    def admit_batch(self, trajectories: list[Trajectory], version: PolicyVersions | int) -> list[TrajectoryResult]:
        """Decide, log (fsync) and buffer a batch, against the versions served now (an int: a server
        without adapters at that version); the answers are durable when this returns."""
        versions = PolicyVersions(version) if isinstance(version, int) else version
        unsampled = [self._not_sampled(t) for t in trajectories]  # hashing needs no lock: concurrent pushes overlap
        with self._lock:
            results: list[TrajectoryResult] = []
            records: list[Record] = []
            accepted: list[tuple[Trajectory, int]] = []
            evaluated = 0
            rejected: list[str] = []
            missing: list[str] = []  # task ids of rejected training trajectories
            batch_ids: set[str] = set()
            batch_signatures: set[str] = set()
            signed = turns = 0
            for trajectory, not_sampled in zip(trajectories, unsampled, strict=True):
                if trajectory.id in self._seen or trajectory.id in batch_ids:
                    results.append(
                        TrajectoryResult(
                            id=trajectory.id, status="duplicate", reason="already received; not trained again"
                        )
                    )
                    continue
                batch_ids.add(trajectory.id)
                problem = (
                    self._problem(trajectory, versions)
                    or not_sampled
                    or self._not_trainable_sample(trajectory, batch_signatures)
                )
                if problem is not None:
                    code, message = problem
                    rejected.append(code)
                    records.append(Rejected(trajectory.id, code))
                    results.append(TrajectoryResult(id=trajectory.id, status="rejected", reason=message))
                    if trajectory.purpose == "train":
                        missing.append(trajectory.task_id)
                    continue
                signatures = tuple(turn.signature for turn in trajectory.turns if turn.signature)
                batch_signatures.update(signatures)
                signed += len(signatures)
                turns += len(trajectory.turns)
                raw = trajectory.model_dump_json().encode()  # what the log line holds, written by pydantic
                if trajectory.purpose == "eval":  # recorded, never buffered for training
                    evaluated += 1
                    records.append(Evaluated(trajectory.id, signatures, raw=raw))
                else:
                    lsn = self.next_lsn + len(accepted)
                    accepted.append((trajectory, lsn))
                    records.append(Accepted(lsn, trajectory.id, signatures, raw=raw))
                results.append(TrajectoryResult(id=trajectory.id, status="accepted"))
            if accepted:  # raises before anything is logged, counted or answered
                self._room(len(accepted), sum(footprint(t) for t, _ in accepted))
            if self.log is not None:
                self.log.append(records)  # raises before anything is counted or answered
            self._seen |= batch_ids
            self._signatures |= batch_signatures
            self.duplicate += len(trajectories) - len(batch_ids)
            self.rejected.update(rejected)
            self.accepted += len(accepted)
            self.accepted_by_tag.update(t.task_tag or "" for t, _ in accepted)
            self.evaluated += evaluated
            self.next_lsn += len(accepted)
            checked = signed if self.signer is not None else 0  # without a key nothing is checked
            self.verified_turns += checked
            self.unsigned_turns += turns - checked
            for trajectory, lsn in accepted:  # under the lock: buffer order == log order
                self._sink(trajectory, lsn)
            for task_id in missing:
                self._absent(task_id)
            position = self.log.position if self.log is not None else None
        if self.log is not None and position is not None:
            # with a mirrored log (--checkpoint-uri), answered once the mirror holds these records (and
            # a duplicate's original): StateError, a 503, when it can't take them in time; the resend waits again
            self.log.wait_mirrored(position)
        return results

    def admit(self, trajectory: Trajectory, version: PolicyVersions | int) -> TrajectoryResult:
        return self.admit_batch([trajectory], version)[0]

    def record_version(self, versions: PolicyVersions | int) -> None:
        """Log that ``versions`` are about to go live (before any trajectory can be sampled by them)."""
        if isinstance(versions, int):
            versions = PolicyVersions(versions)
        with self._lock:
            if self.log is not None:
                self.log.append([Published(versions.current, versions.as_dict() or None)])
            self.known_version = max(self.known_version, versions.current)
            for name, count in versions.adapters.items():
                self.known_adapters[name] = max(self.known_adapters.get(name, 0), count)
            position = self.log.position if self.log is not None else None
        if self.log is not None and position is not None:
            self.log.wait_mirrored(position)

    def log_change(self, record: Configured) -> None:
        """Make an admin change durable (before it is applied or answered)."""
        with self._lock:
            if self.log is not None:
                self.log.append([record])
            position = self.log.position if self.log is not None else None
        if self.log is not None and position is not None:
            self.log.wait_mirrored(position)

    def replay(self, trajectory: Trajectory, lsn: int) -> None:
        """Put back a trajectory accepted by an earlier run (resume): buffered, not counted again."""
        with self._lock:
            self._sink(trajectory, lsn)

    def locked(self) -> threading.Lock:
        """Hold to keep ingestion still (a checkpoint snapshots the buffer and ``next_lsn`` together)."""
        return self._lock

    def mark_trained(self, count: int) -> None:
        with self._lock:
            self.trained += count

    def counts(self, buffered: int, aged_out_groups: int = 0) -> TrajectoryCounts:
        with self._lock:
            return TrajectoryCounts(
                accepted=self.accepted,
                duplicate=self.duplicate,
                rejected=sum(self.rejected.values()),
                rejected_by_reason=dict(self.rejected),
                buffered=buffered,
                aged_out_groups=aged_out_groups,
                trained=self.trained,
                evaluated=self.evaluated,
                verified_turns=self.verified_turns,
                unsigned_turns=self.unsigned_turns,
            )
