"""Restore: a run mirrored to an object store, brought back into a state dir (``up --resume
--checkpoint-uri`` on a machine whose disk lost it, or on a new one).

``reconcile`` runs when the state dir is opened, before the start policy looks at it:

- ``--fresh``: the run in the bucket is deleted too;
- a run in the bucket and none on disk: with ``--resume`` it is restored (below), without it the
  start is refused with the flags to pass;
- a run in both: their ids must match, and the disk wins (``StateMirror.catch_up`` then puts what
  the bucket lacks).

A restore downloads the newest checkpoint whose manifest is there with every file it lists (sizes
and sha256 checked), every compacted segment's ``.ids``, each segment's parts joined back into
``<seg>.wal``, and the run's files. A ``RESTORING`` marker stands in the state dir until all of it is
on disk: a restore that dies is redone from scratch, never taken for a run (a checkpoint without its
log tail would replay too little).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

from agentjet_server.errors import StateError
from agentjet_server.ingest.wal import RECENT, fsync_dir
from agentjet_server.state.checkpoint import (
    METRICS_FILE,
    MODEL_RECORD,
    RUN_ID,
    SAMPLE_KEY,
    StateDir,
    _fsync_tree,
)
from agentjet_server.state.objectstore import CHECKPOINTS, LOG, MANIFEST, ObjectStore, parse_part
from agentjet_server.state.upload import checkpoint_steps

logger = logging.getLogger(__name__)

MARKER = "RESTORING"
_DAMAGED = "restore the object, or delete the checkpoint's MANIFEST.json to resume from an older one"


def remote_run(store: ObjectStore) -> tuple[str | None, dict[str, int]]:
    """The id of the run in the bucket (None when it holds none: no log bytes, no manifest) and its listing."""
    listing = store.list()
    held = any(size for key, size in listing.items() if key.startswith(f"{LOG}/")) or any(
        MANIFEST in files for files in checkpoint_steps(listing).values()
    )
    return (store.run_id() if held else None), listing


def _wipe(state: StateDir) -> None:
    shutil.rmtree(state.log_dir, ignore_errors=True)
    shutil.rmtree(state.checkpoint_dir, ignore_errors=True)
    for name in (RUN_ID, SAMPLE_KEY, MODEL_RECORD, METRICS_FILE):
        (state.root / name).unlink(missing_ok=True)


def reconcile(state: StateDir, store: ObjectStore, *, resume: bool, fresh: bool) -> None:
    marker = state.root / MARKER
    if marker.exists():
        logger.warning("a restore from %s into %s was interrupted: restoring again", store.uri, state.root)
        _wipe(state)
        marker.unlink()
    remote, listing = remote_run(store)
    if fresh:
        if listing:
            logger.warning("--fresh: deleting the earlier run %s in %s", remote or "", store.uri)
            store.delete_all()
        return
    if remote is None:
        return
    if state.describe_earlier_run():
        local = (state.root / RUN_ID).read_text().strip() if (state.root / RUN_ID).is_file() else ""
        if local != remote:
            raise StateError(
                f"--state-dir {state.root} holds run {local or '(no id)'} but --checkpoint-uri {store.uri} holds run "
                f"{remote}: give this server its own --checkpoint-uri, or --fresh to discard both"
            )
        return  # the disk wins; the mirror catches the bucket up before serving
    if not resume:
        raise StateError(
            f"--checkpoint-uri {store.uri} holds an earlier run ({remote}); pass --resume to continue it, "
            "--fresh to discard it, or another --checkpoint-uri"
        )
    marker.write_text(store.uri + "\n")
    fsync_dir(state.root)
    restore(state, store, remote, listing)
    _fsync_tree(state.log_dir)
    _fsync_tree(state.checkpoint_dir)
    marker.unlink()
    fsync_dir(state.root)


def newest_complete(store: ObjectStore, listing: dict[str, int]) -> tuple[str, dict[str, object]] | None:
    """``(step-N, manifest)`` of the newest checkpoint whose manifest is in the bucket; StateError
    if one of the files it lists is missing or of another size (a manifested checkpoint is never
    skipped: once its compaction ran, the older ones can no longer be resumed)."""
    steps = checkpoint_steps(listing)
    for name in sorted((n for n, files in steps.items() if MANIFEST in files), reverse=True):
        manifest = json.loads(store.get(f"{CHECKPOINTS}/{name}/{MANIFEST}"))
        for entry in manifest["files"]:
            size, wanted = steps[name].get(entry["path"]), entry["size"]
            if size != wanted:
                what = "missing" if size is None else f"{size} bytes, not {wanted}"
                raise StateError(f"checkpoint {name} in {store.uri} is damaged: {entry['path']} is {what}; {_DAMAGED}")
        return name, manifest
    return None


def _download_checkpoint(store: ObjectStore, name: str, manifest: dict[str, object], target: Path) -> None:
    files = manifest["files"]
    assert isinstance(files, list)
    for entry in files:
        local = target / entry["path"]
        store.get_file(f"{CHECKPOINTS}/{name}/{entry['path']}", local)
        digest = hashlib.sha256(local.read_bytes()).hexdigest()
        if digest != entry["sha256"]:
            raise StateError(
                f"checkpoint {name} in {store.uri} is damaged: {entry['path']} does not match its manifest's sha256; "
                + _DAMAGED
            )


def join_parts(store: ObjectStore, parts: list[tuple[int, int, str]]) -> bytes:
    """A segment's bytes from its parts ``(start, end, key)``: from 0, each next part is the one
    that starts at or before the end so far and reaches furthest (a retried put may overlap)."""
    data, end = bytearray(), 0
    while True:
        reaching = [p for p in parts if p[0] <= end < p[1]]
        if not reaching:
            break
        start, stop, key = max(reaching, key=lambda p: p[1])
        blob = store.get(key)
        if len(blob) != stop - start:
            break
        data += blob[end - start :]
        end = stop
    rest = [p for p in parts if p[0] > end]
    if rest:
        logger.warning("restore: parts after byte %d of a log segment follow a gap; they are left out", end)
    return bytes(data)


def restore(state: StateDir, store: ObjectStore, run_id: str, listing: dict[str, int]) -> None:
    chosen = newest_complete(store, listing)
    state.checkpoint_dir.mkdir(mode=0o700, exist_ok=True)
    state.log_dir.mkdir(mode=0o700, exist_ok=True)
    if chosen is not None:
        name, manifest = chosen
        _download_checkpoint(store, name, manifest, state.checkpoint_dir / name)
    segments: dict[int, list[tuple[int, int, str]]] = {}
    for key in listing:
        part = parse_part(key)
        if part is not None:
            segments.setdefault(part[0], []).append((part[1], part[2], key))
        elif key.startswith(f"{LOG}/") and (key.endswith(".ids") or key == f"{LOG}/{RECENT}"):
            store.get_file(key, state.log_dir / key.split("/", 1)[1])
    for number, parts in sorted(segments.items()):
        fd = os.open(state.log_dir / f"{number:08d}.wal", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(join_parts(store, parts))
    if chosen is not None:  # the segment the checkpoint opened, even if nothing was written to it
        segment = int(str(chosen[1]["segment"]))
        (state.log_dir / f"{segment:08d}.wal").touch(mode=0o600, exist_ok=True)
    (state.root / RUN_ID).write_text(run_id + "\n")
    for name in (SAMPLE_KEY, MODEL_RECORD, METRICS_FILE):
        if name in listing:
            store.get_file(name, state.root / name)
    if (state.root / SAMPLE_KEY).exists():
        os.chmod(state.root / SAMPLE_KEY, 0o600)
    logger.warning(
        "restored run %s from %s: %s, %d log segments",
        run_id,
        store.uri,
        f"checkpoint {chosen[0]}" if chosen is not None else "no checkpoint yet",
        len(segments),
    )
