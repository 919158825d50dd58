"""Checkpoint upload: each checkpoint written in the state dir is copied to the object store by one
thread, in an order that keeps the bucket resumable at every moment:

1. wait until the log shipper has put every segment before the checkpoint's (the trajectories it
   had buffered, and everything resume replays before its own segment);
2. delete what an earlier, killed upload of the same step left;
3. put every file, then ``MANIFEST.json`` (step, version, run id, and each file's size and sha256):
   a checkpoint without a manifest is never chosen by resume;
4. only then put the ``.ids`` of the segments this checkpoint let the state dir compact (and
   ``recent.wal``), and delete those segments' parts: the previous checkpoint needed them until now;
5. ``metrics.jsonl`` and ``model.json``; then retention: an old checkpoint loses its manifest
   before its files, and manifest-less leftovers older than the newest manifest go too.

While a checkpoint uploads it is pinned in the state dir (local retention skips it). A newer
checkpoint that arrives while one waits replaces it (its compacted segments join the newer one).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from agentjet_server.errors import StateError
from agentjet_server.ingest.wal import RECENT
from agentjet_server.state.checkpoint import METRICS_FILE, MODEL_RECORD, CheckpointMeta, StateDir
from agentjet_server.state.objectstore import CHECKPOINTS, LOG, MANIFEST, ObjectStore, parse_part, sha256_file
from agentjet_server.state.shipping import LogShipper

logger = logging.getLogger(__name__)


@dataclass
class UploadJob:
    path: Path
    meta: CheckpointMeta
    compacted: list[int] = field(default_factory=list)


def checkpoint_steps(listing: dict[str, int]) -> dict[str, dict[str, int]]:
    """The bucket's checkpoints: ``step-N`` -> {relative file path: size} (the manifest included)."""
    steps: dict[str, dict[str, int]] = {}
    for key, size in listing.items():
        parts = key.split("/", 2)
        if len(parts) == 3 and parts[0] == CHECKPOINTS and parts[1].startswith("step-"):
            steps.setdefault(parts[1], {})[parts[2]] = size
    return steps


class CheckpointUploader:
    def __init__(self, store: ObjectStore, state: StateDir, shipper: LogShipper, keep: int) -> None:
        self.store = store
        self.state = state
        self.shipper = shipper
        self.keep = keep
        self.last_uploaded_step: int | None = None
        self.error: str | None = None
        self._cond = threading.Condition()
        self._pending: UploadJob | None = None
        self._busy = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="checkpoint-upload", daemon=True)
        self._thread.start()

    def submit(self, path: Path, meta: CheckpointMeta, compacted: list[int]) -> None:
        """Queue the upload of the checkpoint just written at ``path`` (returns at once)."""
        with self._cond:
            self.state.pinned.add(path)
            earlier = self._pending
            if earlier is not None:  # not started: the newer checkpoint takes its place
                if earlier.path != path:
                    self.state.pinned.discard(earlier.path)
                compacted = sorted({*earlier.compacted, *compacted})
            self._pending = UploadJob(path, meta, list(compacted))
            self._cond.notify_all()

    def flush(self, timeout: float) -> bool:
        """Wait until every submitted checkpoint is uploaded; False if ``timeout`` passed first."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._pending is not None or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 1.0))
        return True

    def close(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        delay = 1.0
        while not self._stop.is_set():
            with self._cond:
                while self._pending is None and not self._stop.is_set():
                    self._cond.wait()
                job, self._pending = self._pending, None
                self._busy = job is not None
            if job is None:
                return
            try:
                done = self.upload(job)
            except (StateError, OSError) as exc:
                done = False
                self.error = f"uploading {job.path.name}: {exc}"
                logger.error("checkpoint upload: %s (retrying in %.0f s)", self.error, delay)
                self._stop.wait(delay)
                delay = min(delay * 2, 60.0)
            with self._cond:
                if not done and self._pending is None and not self._stop.is_set():
                    self._pending = job  # retried, unless a newer checkpoint replaced it
                elif not done and self._pending is not None:
                    self._pending.compacted = sorted({*job.compacted, *self._pending.compacted})
                    if self._pending.path != job.path:
                        self.state.pinned.discard(job.path)
                self._busy = False
                self._cond.notify_all()
            if done:
                delay = 1.0

    def upload(self, job: UploadJob) -> bool:
        """Upload one checkpoint (the steps in the module's docstring). False if asked to stop first."""
        if not self.shipper.wait_shipped((job.meta.segment, 0), self._stop):
            return False
        started = time.perf_counter()
        prefix = f"{CHECKPOINTS}/{job.path.name}/"
        self.store.delete(self.store.list(prefix))
        files = []
        for file in sorted(p for p in job.path.rglob("*") if p.is_file()):
            relative = file.relative_to(job.path).as_posix()
            files.append({"path": relative, "size": file.stat().st_size, "sha256": sha256_file(file)})
            self.store.put_file(prefix + relative, file)
        manifest = {
            "step": job.meta.step,
            "version": job.meta.version,
            "run_id": self.state.run_id,
            "segment": job.meta.segment,
            "created": job.meta.created,
            "files": files,
        }
        self.store.put(prefix + MANIFEST, json.dumps(manifest, indent=1).encode())
        self.compact_remote(job.compacted)
        for name in (METRICS_FILE, MODEL_RECORD):
            if (self.state.root / name).is_file():
                self.store.put_file(name, self.state.root / name)
        self.retain()
        with self._cond:
            self.state.pinned.discard(job.path)
        self.last_uploaded_step, self.error = job.meta.step, None
        size = sum(int(str(f["size"])) for f in files)
        logger.info(
            "checkpoint %s uploaded to %s (%.1f MB in %.1fs)",
            job.path.name,
            self.store.uri,
            size / 1e6,
            time.perf_counter() - started,
        )
        return True

    def compact_remote(self, segments: list[int]) -> None:
        """Put what the state dir kept of ``segments`` (compacted by a checkpoint whose manifest is in
        the bucket), then delete their parts."""
        if not segments:
            return
        log_dir = self.state.log_dir
        if (log_dir / RECENT).is_file():
            self.store.put_file(f"{LOG}/{RECENT}", log_dir / RECENT)
        for number in segments:
            ids = log_dir / f"{number:08d}.ids"
            if ids.is_file():
                self.store.put_file(f"{LOG}/{ids.name}", ids)
        wanted = set(segments)
        parts = [k for k in self.store.list(f"{LOG}/") if (p := parse_part(k)) is not None and p[0] in wanted]
        self.store.delete(parts)

    def retain(self) -> None:
        """Keep the newest ``keep`` complete checkpoints in the bucket."""
        steps = checkpoint_steps(self.store.list(f"{CHECKPOINTS}/"))
        complete = sorted(name for name, files in steps.items() if MANIFEST in files)
        for name in complete[: -self.keep]:
            prefix = f"{CHECKPOINTS}/{name}/"
            self.store.delete([prefix + MANIFEST])  # first: a checkpoint never looks whole while it goes
            self.store.delete(prefix + f for f in steps[name] if f != MANIFEST)
        if complete:
            newest = complete[-1]
            leftovers = [n for n in steps if MANIFEST not in steps[n] and n < newest]
            for name in leftovers:
                self.store.delete(f"{CHECKPOINTS}/{name}/{f}" for f in steps[name])
