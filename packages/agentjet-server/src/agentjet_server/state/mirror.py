"""The state dir's mirror in an object store (``--checkpoint-uri``): what the runtime holds.

The local state dir stays the primary copy (the log is fsynced before a push is answered, a
checkpoint is renamed into place); the bucket follows it: the log's bytes as they are written
(``shipping``), each checkpoint after it is written (``upload``), and the run's id and signing key
before anything is served. One server per prefix: two would overwrite each other's objects.

On start (``attach``) the bucket is caught up with the disk: log bytes it lacks, and the newest
checkpoint if its upload never finished. A bucket that holds more of a segment than the disk means
the disk is older than the run (a stale volume): refused, since serving from it would fork the run.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from agentjet_server.errors import StateError
from agentjet_server.ingest.wal import TrajectoryLog
from agentjet_server.settings import ServerSettings
from agentjet_server.state.checkpoint import MODEL_RECORD, SAMPLE_KEY, CheckpointMeta, StateDir
from agentjet_server.state.objectstore import (
    CHECKPOINTS,
    LOG,
    MANIFEST,
    RUN_FILE,
    ObjectStore,
    open_store,
    parse_part,
    part_key,
)
from agentjet_server.state.restore import reconcile
from agentjet_server.state.shipping import LogShipper
from agentjet_server.state.upload import CheckpointUploader

logger = logging.getLogger(__name__)


def open_state_dir(settings: ServerSettings) -> StateDir:
    """The state dir of ``settings``, with the run in ``--checkpoint-uri`` restored into it when asked."""
    if not settings.checkpoint_uri:
        return StateDir.open(settings.state_dir, resume=settings.resume, fresh=settings.fresh)
    remote = open_store(settings.checkpoint_uri, settings.checkpoint_store_options)
    return StateDir.open(
        settings.state_dir,
        resume=settings.resume,
        fresh=settings.fresh,
        remote=remote,
        reconcile=lambda state: reconcile(state, remote, resume=settings.resume, fresh=settings.fresh),
    )


def covered(parts: list[tuple[int, int]]) -> int:
    """How many bytes from 0 the parts ``(start, end)`` cover without a gap."""
    end = 0
    while reaching := [stop for start, stop in parts if start <= end < stop]:
        end = max(reaching)
    return end


class StateMirror:
    def __init__(self, store: ObjectStore, state: StateDir, settings: ServerSettings) -> None:
        self.store = store
        self.state = state
        self.settings = settings
        self.shipper: LogShipper | None = None
        self.uploader: CheckpointUploader | None = None

    def attach(self, log: TrajectoryLog) -> None:
        """Catch the bucket up with the disk, then mirror every write of ``log`` from now on."""
        self.catch_up_log(log)
        settings = self.settings
        self.shipper = LogShipper(
            self.store, log.position, mode=settings.remote_log, timeout=settings.object_store_timeout_s
        )
        log.mirror = self.shipper
        self.uploader = CheckpointUploader(self.store, self.state, self.shipper, settings.keep_remote_checkpoints)
        self.catch_up_checkpoint(log)

    def catch_up_log(self, log: TrajectoryLog) -> None:
        """Put the bytes of each local segment that the bucket lacks (one part per segment)."""
        parts: dict[int, list[tuple[int, int]]] = {}
        for key in self.store.list(f"{LOG}/"):
            part = parse_part(key)
            if part is not None:
                parts.setdefault(part[0], []).append((part[1], part[2]))
        shipped = 0
        for path in sorted(log.directory.glob("*.wal")):
            if not path.stem.isdigit():
                continue
            number, size = int(path.stem), path.stat().st_size
            there = covered(parts.get(number, []))
            if there > size:
                raise StateError(
                    f"--checkpoint-uri {self.store.uri} holds {there} bytes of log segment {number} but "
                    f"--state-dir {self.state.root} only {size}: the state dir is older than the run. Move it away "
                    "and start with --resume on an empty --state-dir to restore the run from the bucket"
                )
            if there < size:
                with path.open("rb") as f:
                    f.seek(there)
                    self.store.put(part_key(number, there, size), f.read(size - there))
                shipped += size - there
        if shipped:
            logger.info("object store: %d bytes of the trajectory log caught up in %s", shipped, self.store.uri)

    def catch_up_checkpoint(self, log: TrajectoryLog) -> None:
        """The newest local checkpoint, if the bucket lacks it; else the compaction it allowed."""
        assert self.uploader is not None
        latest = self.state.latest()
        if latest is None:
            return
        compacted = sorted(int(p.stem) for p in log.directory.glob("*.ids") if p.stem.isdigit())
        manifest = f"{CHECKPOINTS}/{latest.path.name}/{MANIFEST}"
        if manifest not in self.store.list(manifest):
            logger.info("object store: checkpoint %s is not in %s yet; uploading it", latest.path.name, self.store.uri)
            self.checkpoint_written(latest.path, latest.meta, compacted)
            return
        self.uploader.last_uploaded_step = latest.meta.step
        there = self.store.list(f"{LOG}/")
        self.uploader.compact_remote([n for n in compacted if f"{LOG}/{n:08d}.ids" not in there])

    def upload_run_files(self, run_id: str) -> None:
        """The run's id and signing key (and model record), before anything is served."""
        self.store.put(RUN_FILE, json.dumps({"run_id": run_id}).encode())
        for name in (SAMPLE_KEY, MODEL_RECORD):
            path: Path = self.state.root / name
            if path.is_file():
                self.store.put_file(name, path)

    def put_directory(self, prefix: str, directory: Path) -> None:
        """Every file of ``directory`` under ``prefix/`` in the bucket (the Tinker API's checkpoints), at once."""
        for file in sorted(p for p in directory.rglob("*") if p.is_file()):
            self.store.put_file(f"{prefix}/{file.relative_to(directory).as_posix()}", file)

    def get_directory(self, prefix: str, directory: Path) -> bool:
        """The bucket's files under ``prefix/`` into ``directory``; False if it holds none."""
        found = self.store.list(prefix + "/")
        for key in found:
            target = directory / key[len(prefix) + 1 :]
            target.parent.mkdir(parents=True, exist_ok=True)
            self.store.get_file(key, target)
        return bool(found)

    def checkpoint_written(self, path: Path, meta: CheckpointMeta, compacted: list[int]) -> None:
        if self.uploader is not None:
            self.uploader.submit(path, meta, compacted)

    @property
    def last_uploaded_step(self) -> int | None:
        return self.uploader.last_uploaded_step if self.uploader is not None else None

    @property
    def lag_bytes(self) -> int:
        return self.shipper.lag_bytes if self.shipper is not None else 0

    @property
    def error(self) -> str | None:
        for part in (self.shipper, self.uploader):
            if part is not None and part.error:
                return part.error
        return None

    def close(self, flush: bool) -> None:
        """Stop mirroring; with ``flush``, first wait (up to --checkpoint-upload-timeout) until the
        bucket holds the whole log and the last checkpoint."""
        timeout = self.settings.checkpoint_upload_timeout_s
        if flush and self.shipper is not None and self.uploader is not None:
            logger.warning("uploading the last checkpoint and log to %s", self.store.uri)
            if not (self.shipper.flush(timeout) and self.uploader.flush(timeout)):
                logger.error(
                    "object store %s: the upload did not finish in %.0f s; the bucket resumes from its newest "
                    "complete checkpoint (raise --checkpoint-upload-timeout)",
                    self.store.uri,
                    timeout,
                )
        if self.uploader is not None:
            self.uploader.close()
        if self.shipper is not None:
            self.shipper.close()
