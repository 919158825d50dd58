"""Where else the metrics history goes: ``--log-to tensorboard`` and ``--log-to wandb``.

Each sink receives every history line (``metrics.History``) and logs its numeric figures: step
lines against the learner step, evaluation lines as ``eval/reward`` (and per tag) against the
policy version that sampled them, the minute lines against the step they were written at. Both
packages are optional extras (``pip install 'agentjet-server[tensorboard]'`` / ``[wandb]``), imported
only when asked for; W&B runs offline unless ``WANDB_MODE`` says otherwise (``wandb sync`` uploads
later). Files go under ``<state-dir>/tensorboard`` and ``<state-dir>/wandb``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from agentjet_client.errors import extra_hint
from agentjet_server.errors import ConfigError

logger = logging.getLogger(__name__)

Sink = Callable[[dict[str, Any]], None]
SKIPPED = {"seq", "time", "kind", "step", "id", "task_id", "status"}


def scalars(line: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The numeric figures of a history line, nested dicts flattened as ``a/b``."""
    out: dict[str, float] = {}
    for key, value in line.items():
        if key in SKIPPED and not prefix:
            continue
        name = f"{prefix}{key}"
        if isinstance(value, bool):
            out[name] = float(value)
        elif isinstance(value, int | float):
            out[name] = float(value)
        elif isinstance(value, dict):
            out.update(scalars(value, prefix=f"{name}/"))
    return out


def _where(line: dict[str, Any]) -> tuple[str, int]:
    """(the name prefix, the x value) a line is logged under."""
    if line["kind"] == "eval":
        return "eval/", int(line.get("policy_version") or 0)
    if line["kind"] == "step":
        return "train/", int(line["step"])
    return "run/", int(line.get("step") or 0)


class TensorBoardSink:
    def __init__(self, directory: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ConfigError(
                extra_hint("--log-to tensorboard", "tensorboard", exc, package="agentjet-server")
            ) from exc
        self.writer = SummaryWriter(log_dir=str(directory))
        self.directory = directory

    def __call__(self, line: dict[str, Any]) -> None:
        if line["kind"] == "config":
            self.writer.add_text("config", str(line.get("changes")), int(line.get("step") or 0))
            return
        prefix, x = _where(line)
        for name, value in scalars(line).items():
            self.writer.add_scalar(prefix + name, value, x, walltime=line["time"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self, directory: Path, config: dict[str, Any]) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise ConfigError(extra_hint("--log-to wandb", "wandb", exc, package="agentjet-server")) from exc
        directory.mkdir(parents=True, exist_ok=True)
        options: dict[str, Any] = {
            "project": os.environ.get("WANDB_PROJECT", "agentjet"),
            "dir": str(directory),
            "mode": os.environ.get("WANDB_MODE", "offline"),
            "config": config,
            "resume": "allow",
            "id": os.environ.get("WANDB_RUN_ID") or _run_id(directory),
        }
        self.run: Any = wandb.init(**options)
        self.directory = directory

    def __call__(self, line: dict[str, Any]) -> None:
        prefix, x = _where(line)
        if line["kind"] == "config":
            self.run.config.update({f"live/{k}": v for k, v in (line.get("changes") or {}).items()})
            return
        values = {prefix + name: value for name, value in scalars(line).items()}
        values[f"{prefix}x"] = x
        self.run.log(values)

    def close(self) -> None:
        self.run.finish()


def _run_id(directory: Path) -> str:
    """One W&B run per state dir: a resumed server logs into the same run."""
    marker = directory / "run-id"
    if marker.exists():
        return marker.read_text().strip()
    import uuid

    run_id = uuid.uuid4().hex[:12]
    marker.write_text(run_id)
    return run_id


def open_sinks(names: Sequence[str], state_root: Path, config: dict[str, Any]) -> list[Any]:
    sinks: list[Any] = []
    for name in names:
        if name == "tensorboard":
            sinks.append(TensorBoardSink(state_root / "tensorboard"))
        elif name == "wandb":
            sinks.append(WandbSink(state_root / "wandb", config))
        logger.info("metrics history also goes to %s under %s", name, state_root / name)
    return sinks
