"""Checkpoints and the state directory (``state.checkpoint``), on the real runtime: a checkpoint is a model
transformers loads, shutdown writes one, and a state dir is started fresh, resumed or discarded as asked,
by one server at a time."""

from __future__ import annotations

import pytest
import torch

from agentjet_server.errors import StateError
from agentjet_server.ingest.wal import Rejected, TrajectoryLog
from agentjet_server.state.checkpoint import StateDir
from tests.server.state.runs import GROUP, GROUPS, push, runtime, wait_for, weights


def test_checkpoint_is_a_transformers_model_and_shutdown_saves_one(model_dir, trajectories, tmp_path):
    from transformers import AutoModelForCausalLM

    rt = runtime(model_dir, tmp_path / "state", checkpoint_every=0)
    push(rt, trajectories[: 2 * GROUP * GROUPS])
    wait_for(lambda: rt.loop.learner.steps == 2, "2 steps")
    live = weights(rt)
    rt.close()  # a SIGTERM ends here too: the last checkpoint is written on the way out
    state = StateDir.open(tmp_path / "state", resume=True)
    try:
        checkpoint = state.latest()
        assert checkpoint is not None and checkpoint.meta.step == 2 and checkpoint.meta.version == 2
        assert checkpoint.meta.buffer.lsns() == [] and checkpoint.meta.next_lsn == 2 * GROUP * GROUPS
        model = AutoModelForCausalLM.from_pretrained(checkpoint.model_dir, dtype=torch.float32)
        loaded = model.state_dict()
        assert max(float((loaded[k] - live[k]).abs().max()) for k in live) == 0.0
        assert (checkpoint.model_dir / "tokenizer.json").exists()
    finally:
        state.close()


def test_state_dir_start_policy(model_dir, tmp_path):
    root = tmp_path / "state"
    StateDir.open(root).close()  # empty: fresh
    (root / "log").mkdir(exist_ok=True)
    (root / "log" / "00000001.wal").write_bytes(b"")
    StateDir.open(root).close()  # a server stopped before anything was pushed: nothing to resume
    log = TrajectoryLog(root / "log")
    log.append([Rejected("t0", "stale")])
    log.close()
    with pytest.raises(StateError, match="pass --resume to continue it, --fresh to discard it"):
        StateDir.open(root)
    with pytest.raises(StateError, match="contradict"):
        StateDir.open(root, resume=True, fresh=True)
    held = StateDir.open(root, resume=True)
    try:
        with pytest.raises(StateError, match=r"in use by agentjet-server pid \d+"):
            StateDir.open(root, resume=True)
    finally:
        held.close()
    StateDir.open(root, fresh=True).close()
    assert not (root / "log").exists()
    StateDir.open(root).close()  # discarded: a plain start works again


def test_a_run_keeps_its_id_through_resume_and_gets_a_new_one_when_fresh(tmp_path):
    from agentjet_server.ingest.wal import Accepted, TrajectoryLog

    def opened(**start: bool) -> str:
        state = StateDir.open(tmp_path / "state", **start)
        try:
            return state.run_id
        finally:
            state.close()

    first = opened()
    log = TrajectoryLog(tmp_path / "state" / "log")  # something logged: an earlier run to continue
    log.append([Accepted(lsn=0, id="t-1", trajectory={"id": "t-1"})])
    log.close()
    assert len(first) == 16 and opened(resume=True) == first
    fresh = opened(fresh=True)
    assert fresh != first and opened(resume=True) == fresh
