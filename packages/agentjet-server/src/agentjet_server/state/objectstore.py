"""An object store the state dir is mirrored to (``--checkpoint-uri``): any filesystem fsspec knows,
S3-compatible stores through s3fs (the ``s3`` extra), ``file://`` for a shared mount or a test.

The bucket holds a run under its prefix:

    <uri>/RUN.json                     the run's id (clients key their spool by it)
    <uri>/sample.key                   the key that signs sampled turns (so spooled turns still verify)
    <uri>/model.json  metrics.jsonl    as in the state dir; best effort, with each checkpoint
    <uri>/log/<seg>/<start>-<end>.part byte ranges of a log segment, shipped as they are written
    <uri>/log/<seg>.ids  log/recent.wal  what a compacted segment keeps (``wal``)
    <uri>/checkpoints/step-N/...       a checkpoint's files, then ``MANIFEST.json``, written last

Objects are only ever written whole (one PUT each), so a checkpoint is complete exactly when its
manifest exists and every file it lists has the listed size. Credentials come from where the
store's library looks (for S3: the ``AWS_*`` variables, ``~/.aws``, an instance role); the options
file (``--checkpoint-store-options``) holds the rest, e.g. ``{"endpoint_url": "http://minio:9000"}``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from agentjet_client.errors import extra_hint
from agentjet_server.errors import ConfigError, StateError

logger = logging.getLogger(__name__)

RUN_FILE = "RUN.json"
MANIFEST = "MANIFEST.json"
LOG = "log"
CHECKPOINTS = "checkpoints"
_PART = re.compile(r"^log/(\d{8})/(\d{16})-(\d{16})\.part$")
_CHUNK = 8 << 20


def part_key(segment: int, start: int, end: int) -> str:
    """The object holding bytes ``[start, end)`` of log segment ``segment``."""
    return f"{LOG}/{segment:08d}/{start:016d}-{end:016d}.part"


def parse_part(key: str) -> tuple[int, int, int] | None:
    """``(segment, start, end)`` of a part's key, or None for any other key."""
    match = _PART.match(key)
    return (int(match[1]), int(match[2]), int(match[3])) if match else None


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class ObjectStore:
    """Keys relative to the run's prefix; every failure is a StateError that names the URI and the key
    (never the credentials)."""

    def __init__(self, fs: Any, root: str, uri: str) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self.uri = uri.rstrip("/")
        self._local = getattr(fs, "protocol", None) in ("file", ("file", "local"))

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}" if key else self.root

    def _fail(self, what: str, key: str, exc: BaseException) -> StateError:
        return StateError(
            f"object store {self.uri}: cannot {what} {key or '/'} ({type(exc).__name__}: {exc}); "
            "check --checkpoint-uri, the store's credentials and that it is reachable"
        )

    def put(self, key: str, data: bytes) -> None:
        """Write one object whole (on a local filesystem: a temporary file renamed into place)."""
        try:
            if self._local:
                target = Path(self._path(key))
                target.parent.mkdir(parents=True, exist_ok=True)
                tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.tmp")
                tmp.write_bytes(data)
                os.replace(tmp, target)
            else:
                self.fs.pipe_file(self._path(key), data)
        except Exception as exc:
            raise self._fail("write", key, exc) from exc

    def put_file(self, key: str, path: Path) -> None:
        """Upload a local file as one object (the library splits a large one into a multipart upload,
        which the store shows only once it is complete)."""
        if self._local:  # copied to a temporary file, renamed into place: never seen half written
            try:
                target = Path(self._path(key))
                target.parent.mkdir(parents=True, exist_ok=True)
                tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.tmp")
                shutil.copyfile(path, tmp)
                os.replace(tmp, target)
            except OSError as exc:
                raise self._fail("upload", key, exc) from exc
            return
        try:
            self.fs.put_file(str(path), self._path(key))
        except Exception as exc:
            raise self._fail("upload", key, exc) from exc

    def get(self, key: str) -> bytes:
        try:
            data: bytes = self.fs.cat_file(self._path(key))
        except Exception as exc:
            raise self._fail("read", key, exc) from exc
        return data

    def get_file(self, key: str, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.fs.get_file(self._path(key), str(path))
        except Exception as exc:
            raise self._fail("download", key, exc) from exc

    def list(self, prefix: str = "") -> dict[str, int]:
        """Every object under ``prefix`` (a key's start, relative to the run): key -> size."""
        base = self._path(prefix.rstrip("/")) if prefix else self.root
        try:
            if not self.fs.exists(base):
                return {}
            found = self.fs.find(base, detail=True)
        except Exception as exc:
            raise self._fail("list", prefix, exc) from exc
        listed: dict[str, int] = {}
        for path, info in found.items():
            if path.startswith(self.root + "/") and info.get("type", "file") == "file" and not path.endswith(".tmp"):
                listed[path[len(self.root) + 1 :]] = int(info.get("size") or 0)
        return listed

    def delete(self, keys: Iterable[str]) -> None:
        paths = [self._path(k) for k in keys]
        if not paths:
            return
        try:
            self.fs.rm(paths)
        except FileNotFoundError:
            pass
        except Exception as exc:
            raise self._fail("delete", paths[0][len(self.root) + 1 :], exc) from exc

    def delete_all(self) -> None:
        """Remove the run under the prefix (``--fresh``)."""
        self.delete(self.list())

    def run_id(self) -> str | None:
        """The id of the run the bucket holds, or None when it holds none."""
        if RUN_FILE not in self.list(RUN_FILE):
            return None
        try:
            return str(json.loads(self.get(RUN_FILE))["run_id"])
        except (ValueError, KeyError, TypeError) as exc:
            raise StateError(
                f"object store {self.uri}: {RUN_FILE} is damaged ({exc}); restore it or use --fresh"
            ) from exc


def open_store(uri: str, options_file: Path | None = None) -> ObjectStore:
    """The store at ``uri`` (``s3://bucket/prefix``, ``file:///path``, any fsspec protocol), with the
    fsspec options in ``options_file`` (JSON); ConfigError when the URI or options are wrong or the
    protocol's library is missing, StateError when the store can't be reached."""
    import fsspec
    from fsspec.core import split_protocol

    protocol, rest = split_protocol(uri)
    if not protocol or not rest or not rest.strip("/"):
        raise ConfigError(f"--checkpoint-uri {uri!r} needs a scheme and a path: s3://bucket/prefix or file:///path")
    options: dict[str, Any] = {}
    if options_file is not None:
        try:
            options = json.loads(options_file.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--checkpoint-store-options {options_file}: {exc}; give a JSON object file") from exc
        if not isinstance(options, dict):
            raise ConfigError(f"--checkpoint-store-options {options_file} must hold a JSON object of fsspec options")
    if protocol == "s3":
        options = {"skip_instance_cache": True, "use_listings_cache": False, **options}
    try:
        fs = fsspec.filesystem(protocol, **options)
    except ImportError as exc:
        if protocol == "s3":
            raise ConfigError(extra_hint(f"--checkpoint-uri {uri}", "s3", exc, package="agentjet-server")) from exc
        raise ConfigError(f"--checkpoint-uri {uri}: the {protocol}:// library is not installed: {exc}") from exc
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"--checkpoint-uri {uri}: {exc}") from exc
    root = fs._strip_protocol(uri)
    store = ObjectStore(fs, root, uri)
    if protocol == "file":
        Path(root).mkdir(parents=True, exist_ok=True)
    else:
        bucket = root.split("/", 1)[0]
        try:
            fs.info(bucket)
        except FileNotFoundError as exc:
            raise StateError(
                f"object store {uri}: the bucket {bucket} does not exist (or is not visible); create it"
            ) from exc
        except Exception as exc:
            raise store._fail("reach", "", exc) from exc
    return store
