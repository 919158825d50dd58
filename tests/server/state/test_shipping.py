"""Log shipping (``state.shipping``): with ``--remote-log ack`` a push is answered only once its records are in
the bucket, byte for byte; while the store refuses, a push is a StateError (a 503, nothing acknowledged) and its
resend is a duplicate that waits for the same bytes; pushes that arrive together share a put; with ``async`` the
answer does not wait."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from agentjet_server.errors import StateError
from agentjet_server.ingest.store import TrajectoryStore
from agentjet_server.ingest.wal import TrajectoryLog
from agentjet_server.state.objectstore import ObjectStore, open_store, parse_part
from agentjet_server.state.restore import join_parts
from agentjet_server.state.shipping import LogShipper
from tests.server.ingest.trajectories import traj


class Flaky(ObjectStore):
    """The store, refusing every put while ``down`` is set, each put taking ``delay`` seconds."""

    def __init__(self, inner: ObjectStore, delay: float = 0.0) -> None:
        super().__init__(inner.fs, inner.root, inner.uri)
        self.down = threading.Event()
        self.delay = delay
        self.puts = 0

    def put(self, key: str, data: bytes) -> None:
        time.sleep(self.delay)
        if self.down.is_set():
            raise StateError("the store is down")
        self.puts += 1
        super().put(key, data)


class Shipped:
    def __init__(self, root: Path, mode: str = "ack", delay: float = 0.0, timeout: float = 30.0) -> None:
        self.bucket = Flaky(open_store(f"file://{root}/bucket"), delay)
        self.log = TrajectoryLog(root / "log")
        self.shipper = LogShipper(self.bucket, self.log.position, mode=mode, timeout=timeout)  # type: ignore[arg-type]
        self.log.mirror = self.shipper
        self.store = TrajectoryStore(100, 1000, lambda t, n: None, self.log)

    def segment_in_bucket(self, number: int) -> bytes:
        parts = [(p[1], p[2], k) for k in self.bucket.list("log/") if (p := parse_part(k)) and p[0] == number]
        return join_parts(self.bucket, parts)

    def close(self) -> None:
        self.shipper.close()
        self.log.close()


@pytest.fixture
def shipped(tmp_path: Path):  # type: ignore[no-untyped-def]
    made: list[Shipped] = []

    def make(**options: object) -> Shipped:
        made.append(Shipped(tmp_path / f"run{len(made)}", **options))  # type: ignore[arg-type]
        return made[-1]

    yield make
    for run in made:
        run.close()


def test_an_acknowledged_push_is_in_the_bucket_byte_for_byte(shipped):
    run = shipped()
    assert [r.status for r in run.store.admit_batch([traj(0), traj(1)], 0)] == ["accepted"] * 2
    assert run.segment_in_bucket(1) == (run.log.directory / "00000001.wal").read_bytes()
    second = run.log.rotate()
    run.store.admit_batch([traj(2)], 0)  # answered: the new segment is in the bucket too
    assert run.segment_in_bucket(second) == (run.log.directory / f"{second:08d}.wal").read_bytes()
    run.store.record_version(3)  # a published version waits for the bucket as a push does
    assert run.segment_in_bucket(second) == (run.log.directory / f"{second:08d}.wal").read_bytes()


def test_while_the_store_refuses_a_push_is_not_acknowledged_and_its_resend_waits(shipped):
    run = shipped(timeout=0.5)
    run.bucket.down.set()
    with pytest.raises(StateError, match="nothing of this push is acknowledged: retry it"):
        run.store.admit_batch([traj(0)], 0)
    assert run.shipper.error is not None and "the store is down" in run.shipper.error
    with pytest.raises(StateError):  # still down: the resend is a duplicate, and waits for the original's bytes
        run.store.admit_batch([traj(0)], 0)
    run.bucket.down.clear()
    deadline = time.monotonic() + 30
    while True:  # as a client does: resend until answered (the shipper retries with a backoff)
        try:
            assert [r.status for r in run.store.admit_batch([traj(0)], 0)] == ["duplicate"]
            break
        except StateError:
            assert time.monotonic() < deadline, "the store is back, but the push is never acknowledged"
    assert run.segment_in_bucket(1) == (run.log.directory / "00000001.wal").read_bytes()
    assert run.shipper.error is None


def test_pushes_that_arrive_together_share_a_put(shipped):
    run = shipped(delay=0.05)
    answers: list[str] = []

    def push(i: int) -> None:
        answers.extend(r.status for r in run.store.admit_batch([traj(i)], 0))

    threads = [threading.Thread(target=push, args=(i,)) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert answers == ["accepted"] * 16
    assert run.segment_in_bucket(1) == (run.log.directory / "00000001.wal").read_bytes()
    assert run.bucket.puts < 16, f"{run.bucket.puts} puts for 16 pushes"


def test_async_answers_without_waiting_and_ships_behind(shipped):
    run = shipped(mode="async")
    run.bucket.down.set()
    assert [r.status for r in run.store.admit_batch([traj(0), traj(1)], 0)] == ["accepted"] * 2
    assert run.shipper.lag_bytes > 0
    run.bucket.down.clear()
    assert run.shipper.flush(timeout=30)
    assert run.shipper.lag_bytes == 0
    assert run.segment_in_bucket(1) == (run.log.directory / "00000001.wal").read_bytes()
