"""Where an agent's tasks come from, and which of them are held out for evaluation.

A task source is a list of dicts, a callable returning an iterable of dicts, or a path to

- a JSONL file (one JSON object per line; ``.jsonl``/``.ndjson``), a JSON file holding a list of objects,
  or a CSV file with a header row (every value a string);
- a Parquet file (needs ``pyarrow``: ``pip install 'agentjet-client[datasets]'``);
- a directory of terminal tasks in Harbor's format (``instruction.md``, ``task.toml``, ``tests/``, one directory
  a task; ``sandbox.tasks``): each task is ``{"id", "instruction", "task_dir"}``, run in a sandbox with
  ``sandbox.task_sandbox``;
- a directory written by ``datasets``' ``save_to_disk`` (a ``Dataset``, or a ``DatasetDict`` whose
  split ``split`` names; needs ``datasets``, same extra). Nothing is fetched from a hub: only what is
  on disk is read.

A relative path is read from the directory of the file that defines the agent (its code dir), wherever
``run`` starts. Evaluation tasks (``eval_tasks``) are any source, or taken from the training source:

- a fraction such as ``0.1``: about that share of the tasks, chosen by a hash of each task's id (the same
  tasks whatever the file's order; new tasks in the file never move an old one across), is held out
  and never trained;
- the name of another split of the same ``datasets`` directory (``"test"``).

    @swarm_agent(tasks="tasks.jsonl", eval_tasks=0.1)
    @swarm_agent(tasks="data", split="train", eval_tasks="test")
    @swarm_agent(tasks="train.parquet", eval_tasks="eval.parquet")
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentjet_client.errors import TaskLoadError, extra_hint
from agentjet_client.failures import describe
from agentjet_client.sandbox.tasks import is_task_set, read_task_dirs

Task = dict[str, Any]
TaskSource = Iterable[Task] | Callable[[], Iterable[Task]] | str | os.PathLike[str]
EvalSource = TaskSource | float

FILE_KINDS = (
    ".jsonl, .ndjson, .json, .csv, .parquet, a directory saved with datasets' save_to_disk, or a directory of "
    "terminal task directories (task.toml, instruction.md, tests/test.sh)"
)


def is_path(source: object) -> bool:
    return isinstance(source, (str, os.PathLike))


def _rows_jsonl(path: Path) -> list[Task]:
    rows = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise TaskLoadError(
                    f"{path}, line {number}: not JSON ({exc.msg} at column {exc.colno}); "
                    "a JSONL task file holds one JSON object per line"
                ) from None
    return rows


def _rows_json(path: Path) -> list[Task]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise TaskLoadError(f"{path}: not JSON ({exc.msg}, line {exc.lineno} column {exc.colno})") from None
    if not isinstance(data, list):
        raise TaskLoadError(f"{path} holds a {type(data).__name__}; a JSON task file holds a list of objects")
    return data


def _rows_parquet(path: Path) -> list[Task]:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise TaskLoadError(extra_hint(f"reading {path}", "datasets", exc)) from None
    try:
        rows: list[Task] = pq.read_table(path).to_pylist()
    except Exception as exc:  # pyarrow's own errors (not Parquet, truncated)
        raise TaskLoadError(f"{path} cannot be read as Parquet: {exc}") from None
    return rows


def _rows_saved_dataset(path: Path, split: str | None) -> list[Task]:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # nothing from a hub at run time
    try:
        import datasets
    except ImportError as exc:
        raise TaskLoadError(extra_hint(f"reading the saved dataset {path}", "datasets", exc)) from None
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        names = sorted(loaded)
        if split is None:
            if len(names) != 1:
                raise TaskLoadError(
                    f"{path} holds the splits {', '.join(names)}; name the one to train on "
                    "(@swarm_agent(split=...) or --split)"
                )
            split = names[0]
        if split not in loaded:
            raise TaskLoadError(f"{path} has no split {split!r}; its splits are {', '.join(names)}")
        loaded = loaded[split]
    elif split is not None:
        raise TaskLoadError(f"{path} is a single dataset, not split: leave out split={split!r}")
    return list(loaded.to_list())


def splits_of(path: Path) -> list[str]:
    """The split names of a ``DatasetDict`` saved at ``path`` ([] for anything else)."""
    index = path / "dataset_dict.json"
    if not index.is_file():
        return []
    try:
        return [str(name) for name in json.loads(index.read_text()).get("splits", [])]
    except (OSError, ValueError, AttributeError):
        return []


def read_rows(path: Path, split: str | None = None) -> list[Task]:
    """The rows of a task file or saved dataset (see the module docstring)."""
    if path.is_dir():
        if (path / "dataset_dict.json").is_file() or (path / "dataset_info.json").is_file():
            return _rows_saved_dataset(path, split)
        if is_task_set(path):
            return [task.as_task() for task in read_task_dirs(path)]
        raise TaskLoadError(f"{path} is a directory of neither a saved dataset nor task directories; give {FILE_KINDS}")
    if not path.exists():
        raise TaskLoadError(f"task file {path} does not exist")
    if split is not None:
        raise TaskLoadError(
            f"split={split!r} names a split of a saved datasets directory, and {path} is a file: "
            "hold out evaluation tasks with eval_tasks=0.1 (a fraction) or a second file"
        )
    suffix = path.suffix.lower()
    try:
        if suffix in (".jsonl", ".ndjson"):
            return _rows_jsonl(path)
        if suffix == ".json":
            return _rows_json(path)
        if suffix == ".csv":
            with path.open(newline="", encoding="utf-8") as handle:
                return [dict(row) for row in csv.DictReader(handle)]
        if suffix == ".parquet":
            return _rows_parquet(path)
    except (OSError, UnicodeDecodeError) as exc:
        raise TaskLoadError(f"cannot read task file {path}: {exc}") from None
    raise TaskLoadError(f"{path}: tasks are read from {FILE_KINDS} (not {suffix or 'a file without a suffix'})")


def _share(task_id: str) -> float:
    """Where a task id falls in [0, 1), by its hash: the same on every machine and in every run."""
    return int(hashlib.sha256(task_id.encode()).hexdigest()[:13], 16) / 16**13


def held_out(ids: list[str], fraction: float) -> set[str]:
    """The ids held out by ``fraction``: those whose hash falls below it (about that share of them). Each
    id's fate depends on itself alone, so neither the file's order nor new tasks move a task between the
    training and the held-out part. At least one is held out and one left to train."""
    unique = sorted(set(ids), key=_share)
    out = {task_id for task_id in unique if _share(task_id) < fraction}
    if not out:
        out = set(unique[:1])
    if len(out) == len(unique):
        out.discard(unique[-1])
    return out


@dataclass(frozen=True)
class TaskSpec:
    """An agent's task sources (training and evaluation) and the directory relative paths start from."""

    tasks: TaskSource | None  # None: given on the command line (``--tasks FILE``)
    eval_tasks: EvalSource | None = None
    split: str | None = None
    base: Path | None = None
    owner: str = "the agent"

    def __post_init__(self) -> None:
        held = self.eval_tasks
        if isinstance(held, bool) or (isinstance(held, (int, float)) and not 0 < held < 1):
            raise ValueError(f"eval_tasks={held!r}: a fraction of the tasks to hold out is a number between 0 and 1")

    def _path(self, source: str | os.PathLike[str]) -> Path:
        path = Path(source).expanduser()
        return path if path.is_absolute() or self.base is None else self.base / path

    def _pairs(self, source: TaskSource | None, kind: str, split: str | None = None) -> list[tuple[str, Task]]:
        if source is None:
            raise ValueError(
                f"{self.owner} names no {kind}: give them on the command line (--{kind.replace('_', '-')} FILE) "
                f"or in the decorator (@swarm_agent({kind}=...))"
            )
        if is_path(source):
            rows: Iterable[Any] = read_rows(self._path(source), split)  # type: ignore[arg-type]
        else:
            try:
                rows = list(source() if callable(source) else source)  # type: ignore[arg-type]
            except Exception as exc:  # the agent's own code: say where in it
                raise TaskLoadError(
                    f"loading the {kind} of {self.owner} failed: {describe(exc).trace}{self._beside_hint(exc)}"
                ) from exc
        out = []
        first: dict[str, int] = {}  # task id -> the index of the task that has it
        for index, task in enumerate(rows):
            if not isinstance(task, dict):
                raise ValueError(f"task {index} of {self.owner} is a {type(task).__name__}; tasks must be dicts")
            task_id = str(task.get("id", f"task-{index}"))
            if task_id in first:  # one id is one GRPO group key: two tasks under it would train as one
                raise ValueError(
                    f"tasks {first[task_id]} and {index} of the {kind} of {self.owner} have the same id {task_id!r}; "
                    "give each task its own id (or leave the ids out: tasks are then numbered)"
                )
            first[task_id] = index
            out.append((task_id, task))
        if not out:
            raise ValueError(f"{self.owner} has no {kind}; give @swarm_agent({kind}=...) a non-empty source")
        return out

    def _beside_hint(self, exc: Exception) -> str:
        """For a relative path the agent's own code opened from the directory ``run`` started in, while the
        file is beside the agent: how to open it wherever ``run`` starts."""
        name = getattr(exc, "filename", None) if isinstance(exc, FileNotFoundError) else None
        if not isinstance(name, str) or Path(name).is_absolute() or self.base is None:
            return ""
        if not (self.base / name).exists():
            return ""
        return (
            f"\n{name} is not in the directory `run` started in ({Path.cwd()}) but beside the agent, in {self.base}; "
            f"relative paths are opened from where `run` starts: open it as Path(__file__).parent / {name!r}, "
            f"or give the path itself as the source (tasks={name!r}), which is read from beside the agent"
        )

    def _named_split(self) -> str | None:
        """``eval_tasks`` as the name of another split of the training source's saved dataset."""
        held = self.eval_tasks
        if not isinstance(held, str) or not is_path(self.tasks):
            return None
        return held if held in splits_of(self._path(self.tasks)) else None  # type: ignore[arg-type]

    def load(self, evaluation: bool = False) -> list[tuple[str, Task]]:
        """``(task id, task)`` pairs of the training (or evaluation) tasks."""
        held = self.eval_tasks
        if evaluation and held is None:
            raise ValueError(
                f"{self.owner} has no evaluation tasks; give held-out tasks on the command line (--eval-tasks 0.1: "
                "a tenth of the tasks, or a file) or in the decorator (@swarm_agent(eval_tasks=...))"
            )
        if isinstance(held, float):
            pairs = self._pairs(self.tasks, "tasks", self.split)
            if len(pairs) < 2:
                raise ValueError(f"{self.owner} has one task: there is none to hold out with eval_tasks={held}")
            out = held_out([task_id for task_id, _ in pairs], held)
            return [(i, t) for i, t in pairs if (i in out) == evaluation]
        if not evaluation:
            return self._pairs(self.tasks, "tasks", self.split)
        split = self._named_split()
        if split is not None:
            return self._pairs(self.tasks, "eval_tasks", split)
        assert held is not None
        return self._pairs(held, "eval_tasks")

    def fixed(self, evaluation: bool = False) -> bool:
        """Whether the source is a list in the code (the same tasks until the code changes), not a callable
        that may make new tasks each time or a file that may be edited: those are read again each pass."""
        held = self.eval_tasks
        source = held if evaluation and not isinstance(held, float) and self._named_split() is None else self.tasks
        return not (callable(source) or is_path(source))
