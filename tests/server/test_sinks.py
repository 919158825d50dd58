"""``--log-to tensorboard`` and ``--log-to wandb``: the metrics history in each, read back with the
package's own reader; and a clear error where the package is missing."""

from __future__ import annotations

import json
import struct
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from agentjet_server.errors import ConfigError
from agentjet_server.observe.metrics import History
from agentjet_server.observe.sinks import TensorBoardSink, WandbSink, open_sinks, scalars

STEP = {"step": 1, "policy_version": 1, "loss": 0.5, "mean_reward": 0.25, "reward_by_tag": {"math": 0.25}}


def test_scalars_flatten_a_history_line():
    line = {"seq": 3, "kind": "step", "time": 1.0, **STEP, "paused": False, "id": "x"}
    assert scalars(line) == {
        "policy_version": 1.0,
        "loss": 0.5,
        "mean_reward": 0.25,
        "reward_by_tag/math": 0.25,
        "paused": 0.0,
    }


def test_tensorboard_gets_every_step_and_evaluation(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    history = History(tmp_path / "metrics.jsonl", [TensorBoardSink(tmp_path / "tb")])
    history.append("step", **STEP)
    history.append("step", **{**STEP, "step": 2, "policy_version": 2, "loss": 0.25})
    history.append("eval", policy_version=2, reward=1.0, tag="math", agent_rewards={"default": 1.0})
    history.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 0.5), (2, 0.25)]
    assert [(e.step, e.value) for e in events.Scalars("eval/reward")] == [(2, 1.0)]
    assert [(e.step, e.value) for e in events.Scalars("train/reward_by_tag/math")] == [(1, 0.25), (2, 0.25)]


def test_wandb_logs_offline_into_the_state_dir(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)  # offline is the default
    monkeypatch.setenv("WANDB_SILENT", "true")
    sink = WandbSink(tmp_path / "wandb", {"lr": 0.001})
    history = History(None, [sink])
    history.append("step", **STEP)
    history.append("eval", policy_version=1, reward=0.75, tag="", agent_rewards={})
    history.close()
    [run] = list((tmp_path / "wandb" / "wandb").glob("offline-run-*/run-*.wandb"))
    # wandb's service process writes the file; it is complete once it holds the run's exit record
    deadline = time.monotonic() + 30
    while not wandb_records(run, "exit") and time.monotonic() < deadline:
        time.sleep(0.1)
    rows = wandb_history(run)
    assert [(r["train/x"], r["train/loss"], r["train/reward_by_tag/math"]) for r in rows if "train/x" in r] == [
        (1, 0.5, 0.25)
    ], rows
    assert [(r["eval/x"], r["eval/reward"]) for r in rows if "eval/x" in r] == [(1, 0.75)]
    assert (tmp_path / "wandb" / "run-id").exists()  # a resumed server logs into the same run


def _wandb_records(path: Path) -> list[Any]:
    """The records of an offline W&B run file: a LevelDB-style log (32 KiB blocks of records
    with a 7-byte header: crc, length, full/first/middle/last) of ``Record`` protobufs, after a
    7-byte file header."""
    from wandb.proto import wandb_internal_pb2

    data, position, records, pending = path.read_bytes(), 7, [], b""
    block = 32 * 1024
    while position + 7 <= len(data):
        left = block - position % block
        if left < 7:
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if length == 0 and kind == 0:  # the zero padding at a block's end
            position += left
            continue
        chunk = data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind == 1:
            records.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            records.append(pending + chunk)
    parsed = []
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        parsed.append(record)
    return parsed


def wandb_records(path: Path, kind: str) -> list[Any]:
    return [r for r in _wandb_records(path) if r.WhichOneof("record_type") == kind]


def wandb_history(path: Path) -> list[dict[str, Any]]:
    return [
        {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
        for record in wandb_records(path, "history")
    ]


def test_a_missing_package_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if tensorboard were not installed
    with pytest.raises(ConfigError, match=r"pip install 'agentjet-server\[tensorboard\]'"):
        open_sinks(["tensorboard"], tmp_path, {})
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ConfigError, match=r"pip install 'agentjet-server\[wandb\]'"):
        open_sinks(["wandb"], tmp_path, {})


def test_a_server_started_with_log_to_tensorboard_writes_its_steps(model_dir, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.conftest import LiveServer
    from tests.server.api.test_admin import group, push, wait_for

    state = tmp_path / "state"
    server = LiveServer(model_dir, batch_groups=1, group_size=2, state_dir=state, log_to=["tensorboard"])
    try:
        push(server.url, group(server.url, "t0"))
        wait_for(lambda: server.runtime.loop.learner.steps == 1)
    finally:
        server.stop()
    events = EventAccumulator(str(state / "tensorboard"))
    events.Reload()
    [loss] = events.Scalars("train/loss")
    step = json.loads(next(x for x in (state / "metrics.jsonl").read_text().splitlines() if '"kind":"step"' in x))
    assert loss.step == 1 and loss.value == pytest.approx(step["loss"])
