"""Checkpoints and the state directory: what ``--resume`` continues from.

    <state-dir>/
      LOCK                      held by the running server (one server per state dir)
      model.json                the model the run started from: its path and served name
      run_id                    names this run: kept by --resume, new after --fresh (clients key their
                                spool by it, so leftovers meet the run that sampled them)
      log/                      the trajectory write-ahead log (``wal``)
      metrics.jsonl             the run's metrics history (a line per step, and one a minute)
      checkpoints/step-00000020/
        model/                  HF safetensors + config + tokenizer: loadable by transformers
        adapter/                with --lora-rank: the LoRA adapter in peft's format (vLLM loads it too)
        adapters/NAME/          with an adapter per agent: each adapter so (model/ holds the base)
        trainer.pt              optimizer state (by parameter name), learner step, RNG (and the adapter)
        state.json              policy version, log position, buffered trajectories, counts

A checkpoint is written into a ``.tmp`` directory, fsynced, then renamed into place, so the
newest ``step-*`` directory is always complete. Resume = load it, then put back into the group
buffer the trajectories it had buffered and every trajectory logged after it, in log order:
nothing acknowledged is lost and nothing already trained is trained again.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import torch

from agentjet_server.batching.buffer import BufferSnapshot
from agentjet_server.errors import StateError
from agentjet_server.ingest.wal import fsync_dir

if TYPE_CHECKING:
    from agentjet_server.state.objectstore import ObjectStore

logger = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")
METRICS_FILE = "metrics.jsonl"  # the run's metrics history (``metrics.History``)
MODEL_RECORD = "model.json"  # the model a run started from
RUN_ID = "run_id"
SAMPLE_KEY = "sample.key"  # signs sampled turns (``ingest/signing``)


def recorded_model(root: Path) -> dict[str, str] | None:
    """What ``StateDir.record_model`` noted in the state dir ``root`` (read-only: a server may hold it)."""
    try:
        record = json.loads((root / MODEL_RECORD).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


# settings that change what a resumed run computes; a change is allowed but reported
TRAINING_SETTINGS = ("group_size", "batch_groups", "lr", "clip_low", "clip_high", "max_grad_norm", "entropy_coef")


@dataclass
class CheckpointMeta:
    step: int
    version: int
    next_lsn: int  # trajectories with a log sequence number from here on came after this checkpoint
    buffer: BufferSnapshot
    trained: int
    skipped_batches: int
    segment: int  # the log segment opened right after the checkpoint
    settings: dict[str, Any] = field(default_factory=dict)
    created: float = 0.0
    live: dict[str, Any] = field(default_factory=dict)  # settings changed through the admin API
    paused: bool = False  # learning paused through the admin API
    adapter_versions: dict[str, int] = field(default_factory=dict)  # an adapter per agent: each one's version

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> CheckpointMeta:
        data = json.loads(text)
        data["buffer"] = BufferSnapshot(**data["buffer"])
        return cls(**data)


@dataclass
class Checkpoint:
    path: Path
    meta: CheckpointMeta

    @property
    def model_dir(self) -> Path:
        return self.path / "model"

    def trainer_state(self) -> dict[str, Any]:
        """Weights (from the safetensors) plus optimizer, step count and RNG, for ``Learner.load_training_state``."""
        from safetensors.torch import load_file

        weights: dict[str, torch.Tensor] = {}
        for file in sorted(self.model_dir.glob("*.safetensors")):
            weights.update(load_file(str(file)))
        if not weights:
            raise StateError(
                f"checkpoint {self.path} has no model weights; it is damaged: remove it to resume from an older one"
            )
        state: dict[str, Any] = torch.load(self.path / "trainer.pt", map_location="cpu", weights_only=True)
        state["weights"] = weights
        return state


def _lock_file(handle: IO[str]) -> None:
    """An exclusive lock held until ``handle`` is closed (or the process dies); OSError if taken."""
    try:
        import fcntl
    except ImportError:  # Windows
        import msvcrt

        handle.seek(0)
        msvcrt.locking(handle.fileno(), msvcrt.LK_NBLCK, 1)  # type: ignore[attr-defined]
        return
    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)


def _owner_only(root: Path) -> None:
    """The state dir holds every prompt and the signing key: no access for other local users."""
    try:
        if root.stat().st_uid == os.getuid() and root.stat().st_mode & 0o077:
            os.chmod(root, 0o700)
    except (OSError, AttributeError) as exc:  # AttributeError: no getuid (Windows)
        logger.warning("could not make --state-dir %s private (mode 0700): %s", root, exc)


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())
    for path in sorted((p for p in root.rglob("*") if p.is_dir()), reverse=True):
        fsync_dir(path)
    fsync_dir(root)


class StateDir:
    """The server's state directory, locked for this process. ``open`` applies the start policy:

    - nothing there: a fresh start;
    - an earlier run's state and ``resume``: continue from its newest checkpoint (or from the
      initial model, replaying the whole log, if it never wrote one);
    - an earlier run's state and ``fresh``: it is deleted;
    - an earlier run's state and neither: an error that says which flag to pass.
    """

    def __init__(self, root: Path, lock: IO[str]) -> None:
        self.root = root
        self._lock = lock
        self.log_dir = root / "log"
        self.checkpoint_dir = root / "checkpoints"
        self.resumed: Checkpoint | None = None
        self.resuming = False
        self.run_id = ""  # set by ``open``
        self.pinned: set[Path] = set()  # checkpoints being uploaded: retention leaves them
        self.remote: ObjectStore | None = None  # --checkpoint-uri: the store the run is mirrored to

    @classmethod
    def open(
        cls,
        root: Path,
        *,
        resume: bool = False,
        fresh: bool = False,
        remote: ObjectStore | None = None,
        reconcile: Callable[[StateDir], None] | None = None,
    ) -> StateDir:
        """``remote``: the object store the run is mirrored to; ``reconcile`` (``restore.reconcile``) runs
        once the lock is held, so that a run restored from it meets the start policy below as a local one."""
        if resume and fresh:
            raise StateError("--resume and --fresh contradict each other; pass one of them")
        try:
            root.mkdir(mode=0o700, parents=True, exist_ok=True)
            _owner_only(root)
            lock = os.fdopen(os.open(root / "LOCK", os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600), "a+")
        except OSError as exc:
            raise StateError(f"cannot use --state-dir {root}: {exc}") from exc
        try:
            _lock_file(lock)
        except OSError as exc:
            lock.seek(0)
            holder = lock.read().strip() or "another process"
            lock.close()
            raise StateError(
                f"--state-dir {root} is in use by {holder}; stop that server, or give this one its own --state-dir"
            ) from exc
        lock.seek(0)
        lock.truncate()
        lock.write(f"agentjet-server pid {os.getpid()}\n")
        lock.flush()
        state = cls(root, lock)
        state.remote = remote
        if reconcile is not None:
            try:
                reconcile(state)
            except BaseException:
                state.close()
                raise
        earlier = state.describe_earlier_run()
        if earlier and not (resume or fresh):
            state.close()
            raise StateError(
                f"--state-dir {root} holds an earlier run ({earlier}); pass --resume to continue it, "
                "--fresh to discard it, or another --state-dir"
            )
        if earlier and fresh:
            logger.warning("--fresh: discarding the earlier run in %s (%s)", root, earlier)
            shutil.rmtree(state.log_dir, ignore_errors=True)
            shutil.rmtree(state.checkpoint_dir, ignore_errors=True)
            (root / METRICS_FILE).unlink(missing_ok=True)
        if resume:
            state.resuming = bool(earlier)
            state.resumed = state.latest()
            if not earlier:
                logger.info("--resume: nothing to resume in %s; starting fresh", root)
        state.checkpoint_dir.mkdir(mode=0o700, exist_ok=True)
        for leftover in state.checkpoint_dir.glob("*.tmp"):  # a checkpoint a crash interrupted
            shutil.rmtree(leftover, ignore_errors=True)
        state.run_id = state._run_id(keep=resume)
        return state

    def _run_id(self, keep: bool) -> str:
        """The run's id: the earlier one when it is continued, else a new one (written before serving)."""
        path = self.root / RUN_ID
        if keep and path.exists():
            return path.read_text().strip()
        run_id = uuid.uuid4().hex[:16]
        try:
            path.write_text(run_id + "\n")
        except OSError as exc:
            raise StateError(f"cannot write {path}: {exc.strerror}; fix --state-dir") from exc
        return run_id

    def describe_earlier_run(self) -> str:
        # a server that stopped before anything was pushed leaves an empty segment: nothing to resume
        logged = any(p.stat().st_size for p in self.log_dir.glob("*.wal")) or any(self.log_dir.glob("*.ids"))
        latest = self.latest()
        if latest is not None:
            return f"checkpoint at step {latest.meta.step}, policy v{latest.meta.version}"
        return "a trajectory log, no checkpoint yet" if logged else ""

    def record_model(self, path: Path, name: str) -> None:
        """Note the model this run started from (``inspect`` reads it before the first checkpoint)."""
        record = {"path": str(path.resolve()), "name": name}
        try:
            (self.root / MODEL_RECORD).write_text(json.dumps(record) + "\n")
        except OSError as exc:
            raise StateError(f"cannot write {self.root / MODEL_RECORD}: {exc.strerror}; fix --state-dir") from exc

    def checkpoints(self) -> list[Path]:
        if not self.checkpoint_dir.is_dir():
            return []
        return sorted(p for p in self.checkpoint_dir.glob("step-*") if p.is_dir() and not p.name.endswith(".tmp"))

    def latest(self) -> Checkpoint | None:
        for path in reversed(self.checkpoints()):
            meta_file = path / "state.json"
            if meta_file.exists():
                return Checkpoint(path, CheckpointMeta.from_json(meta_file.read_text()))
        return None

    def write(
        self, meta: CheckpointMeta, trainer_state: dict[str, Any], model: Any, source_model: Path, keep: int
    ) -> Path:
        """Write a checkpoint atomically; keep the newest ``keep``. ``model`` gives the config to save."""
        final = self.checkpoint_dir / f"step-{meta.step:08d}"
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            model_dir = tmp / "model"
            model_dir.mkdir(parents=True)
            model.save_pretrained(str(model_dir), state_dict=trainer_state["weights"])
            for item in source_model.iterdir():  # tokenizer, chat template, ...: what the weights don't carry
                if item.is_file() and not item.name.endswith(WEIGHT_SUFFIXES) and not (model_dir / item.name).exists():
                    shutil.copy2(item, model_dir / item.name)
            if "adapter" in trainer_state:  # LoRA: the adapter alone too, as peft and vLLM load it
                from agentjet_server.engine.adapter import LoraSpec, write_adapter

                spec = LoraSpec(**trainer_state["lora"])
                write_adapter(tmp / "adapter", trainer_state["adapter"], spec, str(source_model))
            if "adapters" in trainer_state:  # an adapter per agent: each alone, as peft and vLLM load it
                from agentjet_server.engine.adapter import LoraSpec, write_adapter

                spec = LoraSpec(**trainer_state["lora"])
                for name, tensors in trainer_state["adapters"].items():
                    write_adapter(tmp / "adapters" / name, tensors, spec, str(source_model), name=name)
            rest = {k: v for k, v in trainer_state.items() if k != "weights"}
            torch.save(rest, tmp / "trainer.pt")
            meta.created = time.time()
            (tmp / "state.json").write_text(meta.to_json())
            _fsync_tree(tmp)
            if final.exists():  # the same step again (a shutdown right after a periodic checkpoint)
                shutil.rmtree(final)
            tmp.rename(final)
            fsync_dir(self.checkpoint_dir)
        except Exception as exc:  # OSError, or a writer's own error (safetensors) on a full or read-only disk
            shutil.rmtree(tmp, ignore_errors=True)
            raise StateError(f"cannot write checkpoint {final}: {exc}; free disk space or fix permissions") from exc
        for old in self.checkpoints()[:-keep]:
            if old not in self.pinned:
                shutil.rmtree(old, ignore_errors=True)
        return final

    def close(self) -> None:
        if not self._lock.closed:
            self._lock.close()  # closing the file releases the lock


def read_checkpoint(path: Path) -> Checkpoint:
    """The checkpoint at ``path``: a ``step-*`` directory, or a state dir (its newest complete one).
    Read-only: another server may hold the state dir. StateError says what is there instead."""
    path = path.expanduser()
    if (path / "state.json").is_file():
        return Checkpoint(path, CheckpointMeta.from_json((path / "state.json").read_text()))
    if (path / "checkpoints").is_dir():
        steps = sorted(p for p in (path / "checkpoints").glob("step-*") if not p.name.endswith(".tmp"))
        for step in reversed(steps):
            if (step / "state.json").is_file():
                return Checkpoint(step, CheckpointMeta.from_json((step / "state.json").read_text()))
        raise StateError(f"the state dir {path} has no complete checkpoint yet; ask its server for one first")
    what = "does not exist" if not path.exists() else "is neither a checkpoint (step-*) nor a state dir"
    raise StateError(f"{path} {what}: give a checkpoint directory (<state-dir>/checkpoints/step-N) or a state dir")


def settings_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Training settings that differ between a checkpoint and this run, as ``name a -> b``."""
    return [
        f"{name} {saved[name]} -> {current.get(name)}"
        for name in TRAINING_SETTINGS
        if name in saved and saved[name] != current.get(name)
    ]
