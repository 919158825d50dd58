"""The learner's step reads top to bottom: traced with ``sys.setprofile`` from a built batch to the loss, one
``Learner.step`` runs code in at most five of the server's source files, and none of them is re-entered
(called again while one of its own calls is still on the stack below another file of ours: a call back up).

The trace records every Python call whose code lies in ``agentjet_server`` (torch and transformers are not
counted; the learner's attention function, which transformers calls, is ours and counted)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

import agentjet_server
from agentjet_client.protocol import Trajectory
from agentjet_server.learner.batch import build_batch
from agentjet_server.learner.trainer import Learner, LearnerConfig
from tests.server.learner.groups import _turn

PACKAGE = Path(agentjet_server.__file__).resolve().parent


class FileTrace:
    """The files under ``root`` in call order, and every re-entry: a call into one of them that is on the
    stack already, under another of them."""

    def __init__(self, root: Path = PACKAGE) -> None:
        self.root = root
        self.files: list[str] = []
        self.reentries: list[str] = []
        self._stack: list[str] = []  # our file of each open Python frame ("" for anyone else's)

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            path = Path(frame.f_code.co_filename)
            ours = path.is_relative_to(self.root)
            name = str(path.relative_to(self.root)) if ours else ""
            if ours:
                if name not in self.files:
                    self.files.append(name)
                below = [f for f in self._stack if f]
                if name in below and below[-1] != name:
                    self.reentries.append(f"{name} ({frame.f_code.co_name}) under {' > '.join(below)}")
            self._stack.append(name)
        elif event == "return" and self._stack:
            self._stack.pop()


def traced_step(learner: Learner, batch: Any) -> FileTrace:
    trace = FileTrace()
    sys.setprofile(trace)
    try:
        learner.step(batch)
    finally:
        sys.setprofile(None)
    return trace


def episodes() -> list[Trajectory]:
    return [
        Trajectory(id=f"e{i}", task_id="t", turns=[_turn([1, 2, 3], [10 + i, 20], [7, 6])], reward=float(i))
        for i in range(4)
    ]


def pairs(model_dir: Path) -> Any:
    from agentjet_server.engine.tokens import ChatTokenizer
    from agentjet_server.learner.preference import pairs_batch

    ask = [{"role": "user", "content": "Write two as a digit."}]
    rows = [{"prompt": ask, "chosen": "2", "rejected": "3", "ref_chosen_logps": -1.0, "ref_rejected_logps": -2.0}]
    return pairs_batch(ChatTokenizer(model_dir), rows * 2, 0.1, train=True)[0]


@pytest.mark.parametrize(
    "config",
    [
        LearnerConfig(),  # GRPO, the decoupled objective: a proximal pass
        LearnerConfig(algorithm="ppo", kl_coef=0.1, entropy_coef=0.01),  # critic, GAE, reference KL, entropy
        LearnerConfig(off_policy="tis", mini_batches=2, epochs=2),
        LearnerConfig(policy_loss="gspo", loss_aggregation="seq-mean-token-mean"),
        LearnerConfig(token_mask=(0.5, 5.0), sequence_is=True, mismatch_kl_coef=0.1, mini_batches=2),
        None,  # a DPO step: each pair's weight from the sequences' log-probs, then the weighted loss
    ],
    ids=["grpo", "ppo-kl", "tis-minibatches", "gspo-seq-mean", "rollout-correction", "dpo"],
)
def test_one_step_passes_through_at_most_five_files_none_re_entered(model_dir, config):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    reference = AutoModelForCausalLM.from_pretrained(model_dir) if config is not None and config.kl_coef else None
    learner = Learner(model, config or LearnerConfig(), pad_id=0, reference=reference)
    algorithm = learner.config.algorithm

    def batch(version: int) -> Any:
        return pairs(model_dir) if config is None else build_batch([episodes()], version=version, algorithm=algorithm)

    learner.step(batch(7))  # imports and first-call set-up out of the way
    trace = traced_step(learner, batch(8))
    print(" > ".join(trace.files))
    assert trace.files[:3] == ["learner/trainer.py", "learner/packing.py", "learner/prepare.py"], trace.files
    assert len(trace.files) <= 5, trace.files
    assert trace.reentries == [], trace.reentries


def test_the_trace_sees_a_call_back_into_a_file(tmp_path, monkeypatch):
    """The check can fail: a module that hands another one of its own functions to call is re-entered."""
    (tmp_path / "caller.py").write_text(
        "import callee\n\ndef run():\n    return callee.apply(double)\n\ndef double(x):\n    return 2 * x\n"
    )
    (tmp_path / "callee.py").write_text("def apply(function):\n    return function(21)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import caller  # type: ignore[import-not-found]

    trace = FileTrace(tmp_path)
    sys.setprofile(trace)
    try:
        assert caller.run() == 42
    finally:
        sys.setprofile(None)
    assert trace.files == ["caller.py", "callee.py"]
    assert trace.reentries == ["caller.py (double) under caller.py > callee.py"]
