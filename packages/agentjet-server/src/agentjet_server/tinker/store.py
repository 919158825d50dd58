"""What the Tinker API keeps beside the model: sessions and their heartbeats, the sequences its samplers
returned (stable_reinforce checks a datum's provenance against them), and checkpoints on disk.

Lifetimes and limits: a session lives while it heartbeats (the SDK sends one every few seconds) and
``SESSION_TTL_S`` after its last; when it lapses, its sequences are dropped and its training models are
unloaded (their saved checkpoints stay). At most ``MAX_SEQUENCES`` sequences and ``MAX_SEQUENCE_TOKENS``
tokens are kept over all sessions, the least recently sampled going first; a datum that names one no
longer kept is refused with a 400 that says so.

Checkpoints: ``tinker://MODEL_ID/weights/NAME`` (``save_state``: the adapter in peft's format, its
optimizer state and what it was created with) and ``tinker://MODEL_ID/sampler_weights/NAME``
(``save_weights_for_sampler``: the adapter alone), under the server's state directory (``tinker/``),
mirrored to the bucket with the rest of the state when ``--checkpoint-uri`` is set.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from agentjet_server.errors import InvalidRequestError, NotFoundError

SESSION_TTL_S = 900.0
MAX_SEQUENCES = 200_000
MAX_SEQUENCE_TOKENS = 50_000_000
KINDS = {"weights": "training", "sampler_weights": "sampler"}


@dataclass
class Kept:
    """A sampled sequence as the server sampled it."""

    session_id: str
    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]

    @property
    def size(self) -> int:
        return len(self.prompt) + len(self.tokens)


class Sessions:
    def __init__(self, ttl_s: float = SESSION_TTL_S) -> None:
        self.ttl_s = ttl_s
        self.last: dict[str, float] = {}
        self.lock = threading.Lock()

    def create(self, session_id: str) -> None:
        with self.lock:
            self.last[session_id] = time.monotonic()

    def beat(self, session_id: str) -> bool:
        with self.lock:
            if session_id not in self.last:
                return False
            self.last[session_id] = time.monotonic()
            return True

    def end(self, session_id: str) -> None:
        with self.lock:
            self.last.pop(session_id, None)

    def lapsed(self) -> list[str]:
        """The sessions whose heartbeats stopped more than ``ttl_s`` ago (forgotten here)."""
        now = time.monotonic()
        with self.lock:
            gone = [s for s, t in self.last.items() if now - t > self.ttl_s]
            for s in gone:
                del self.last[s]
        return gone

    def known(self, session_id: str) -> bool:
        with self.lock:
            return session_id in self.last


class Sequences:
    def __init__(self, max_sequences: int = MAX_SEQUENCES, max_tokens: int = MAX_SEQUENCE_TOKENS) -> None:
        self.max_sequences, self.max_tokens = max_sequences, max_tokens
        self._items: OrderedDict[str, Kept] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()

    def add(self, sequence_id: str, kept: Kept) -> None:
        with self._lock:
            self._items[sequence_id] = kept
            self._tokens += kept.size
            while self._items and (len(self._items) > self.max_sequences or self._tokens > self.max_tokens):
                _, old = self._items.popitem(last=False)
                self._tokens -= old.size

    def get(self, sequence_id: str) -> Kept:
        with self._lock:
            kept = self._items.get(sequence_id)
        if kept is None:
            raise InvalidRequestError(
                f"no sampled sequence {sequence_id!r} is kept here: it was never sampled by this server, or its "
                "session ended, or it was among the oldest dropped (stable_reinforce needs the sequence's sampler "
                "log-probabilities; sample again, or train it with another loss)",
                param="sequence_id",
            )
        return kept

    def drop_session(self, session_id: str) -> None:
        with self._lock:
            for key in [k for k, v in self._items.items() if v.session_id == session_id]:
                self._tokens -= self._items.pop(key).size

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)


def tinker_path(model_id: str, kind: str, name: str) -> str:
    return f"tinker://{model_id}/{kind}/{name}"


def parse_path(path: str) -> tuple[str, str, str]:
    """``tinker://MODEL_ID/KIND/NAME`` as its parts, or a 400 that shows the form."""
    parts = path[len("tinker://") :].split("/") if path.startswith("tinker://") else []
    if len(parts) != 3 or parts[1] not in KINDS or not parts[0] or not parts[2]:
        raise InvalidRequestError(
            f"{path!r} is not a checkpoint path: they look like tinker://MODEL_ID/weights/NAME or "
            "tinker://MODEL_ID/sampler_weights/NAME",
            param="path",
        )
    return parts[0], parts[1], parts[2]


def check_name(name: str) -> str:
    if not name or "/" in name or name.startswith(".") or len(name) > 200:
        raise InvalidRequestError(f"checkpoint name {name!r}: a non-empty name without '/'", param="path")
    return name


class Remote(Protocol):
    """The bucket the state dir is mirrored to (``state.mirror.StateMirror``)."""

    def put_directory(self, prefix: str, directory: Path) -> None: ...

    def get_directory(self, prefix: str, directory: Path) -> bool: ...


class Checkpoints:
    """Checkpoint directories under ``root``: ``MODEL_ID/KIND/NAME/`` with ``meta.json`` beside the tensors;
    with ``remote``, each written to the bucket too (under ``tinker/``) before its save is answered, and one
    this disk lacks (a server started on another machine from the bucket) fetched from there."""

    def __init__(self, root: Path, remote: Remote | None = None) -> None:
        self.root, self.remote = root, remote

    def directory(self, path: str) -> Path:
        model_id, kind, name = parse_path(path)
        return self.root / model_id / kind / name

    def existing(self, path: str) -> Path:
        directory = self.directory(path)
        if not (directory / "meta.json").exists() and self.remote is not None:
            self.remote.get_directory(self.key(directory), directory)
        if not (directory / "meta.json").exists():
            raise NotFoundError(f"no checkpoint {path} on this server (list them: RestClient.list_checkpoints)")
        return directory

    def key(self, directory: Path) -> str:
        return f"tinker/{directory.relative_to(self.root).as_posix()}"

    def write_meta(self, directory: Path, meta: dict[str, Any]) -> None:
        """``meta.json``, which completes a checkpoint; then the whole of it to the bucket, if there is one."""
        meta = {**meta, "time": datetime.now(UTC).isoformat()}
        (directory / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        if self.remote is not None and not directory.name.startswith("ephemeral-"):
            self.remote.put_directory(self.key(directory), directory)

    def meta(self, path: str) -> dict[str, Any]:
        return json.loads((self.existing(path) / "meta.json").read_text())  # type: ignore[no-any-return]

    def listing(self, model_id: str) -> list[dict[str, Any]]:
        """The model's checkpoints, oldest first, in the SDK's ``Checkpoint`` shape."""
        out = []
        for kind, label in KINDS.items():
            base = self.root / model_id / kind
            for directory in sorted(base.iterdir()) if base.is_dir() else []:
                meta_file = directory / "meta.json"
                if not meta_file.exists() or directory.name.startswith("ephemeral-"):
                    continue
                meta = json.loads(meta_file.read_text())
                size = sum(f.stat().st_size for f in directory.iterdir() if f.is_file())
                out.append(
                    {
                        "checkpoint_id": f"{kind}/{directory.name}",
                        "checkpoint_type": label,
                        "time": meta["time"],
                        "tinker_path": tinker_path(model_id, kind, directory.name),
                        "size_bytes": size,
                        "public": False,
                        "user_metadata": meta.get("user_metadata"),
                    }
                )
        return sorted(out, key=lambda c: c["time"])

    def models(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if p.is_dir()) if self.root.is_dir() else []
