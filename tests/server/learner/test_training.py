"""The data modes behind ``Training`` on a real runtime (no HTTP): a supervised update is a served step and an
evaluation changes nothing; a DPO evaluation's figures are the pair loss computed by hand from the answers'
log-probs; a request for the wrong adapter, or to a server that only serves, is refused with what to do."""

from __future__ import annotations

import math

import pytest

from agentjet_server.errors import ConflictError, InvalidRequestError
from agentjet_server.learner.training import DataStep
from tests.server.learner.test_preference import digit_pairs
from tests.server.learner.test_supervised import digit_chats
from tests.server.state.runs import runtime


def test_a_supervised_update_is_a_served_step_and_evaluation_changes_nothing(model_dir, tmp_path):
    rt = runtime(model_dir, tmp_path / "state")
    try:
        chats = digit_chats()
        before = rt.training.run(DataStep("sft", evaluate=True), chats)
        assert rt.training.run(DataStep("sft", evaluate=True), chats)["loss"] == before["loss"]
        version = rt.loop.live[0]
        for _ in range(40):  # AdamW's first steps may raise the loss before it falls
            answer = rt.training.run(DataStep("sft", lr=3e-3), chats)
        assert answer["policy_version"] == version + 40 and answer["examples"] == 10 and answer["tokens"] == 20
        assert rt.training.run(DataStep("sft", evaluate=True), chats)["loss"] < 0.5 * before["loss"]
        assert {g["lr"] for g in rt.loop.trainer.optimizer.param_groups} == {1e-2}  # the update's own rate, then back
    finally:
        rt.close(checkpoint=False)


def test_dpo_figures_are_the_pair_loss_of_the_answers_log_probs(model_dir, tmp_path):
    rt = runtime(model_dir, tmp_path / "state")
    try:
        pairs = digit_pairs()[:4]
        scored = rt.training.run(DataStep("dpo", evaluate=True), pairs)
        referenced = [
            {**pair, "ref_chosen_logps": c - 0.5 * i, "ref_rejected_logps": r}
            for i, (pair, c, r) in enumerate(zip(pairs, scored["chosen_logps"], scored["rejected_logps"], strict=True))
        ]
        figures = rt.training.run(DataStep("dpo", evaluate=True, beta=0.5), referenced)
        margins = [0.5 * (0.5 * i) for i in range(4)]  # beta * ((c - ref c) - (r - ref r))
        assert figures["loss"] == pytest.approx(sum(math.log1p(math.exp(-m)) for m in margins) / 4, rel=1e-6)
        assert figures["reward_margin"] == pytest.approx(sum(margins) / 4, rel=1e-6)
        assert figures["accuracy"] == 0.75  # the first pair's margin is 0: not ordered right
    finally:
        rt.close(checkpoint=False)


def test_the_wrong_adapter_and_a_serving_only_server_are_refused_with_what_to_do(model_dir, tmp_path):
    rt = runtime(model_dir, tmp_path / "state")
    try:
        with pytest.raises(InvalidRequestError, match="name no adapter \\(it trains one model\\), not 'coder'"):
            rt.training.run(DataStep("sft", adapter="coder"), digit_chats())
    finally:
        rt.close(checkpoint=False)
    serving = runtime(model_dir, tmp_path / "serving", serve_only=True)
    try:
        with pytest.raises(ConflictError, match="--serve-only and trains nothing"):
            serving.training.run(DataStep("dpo"), digit_pairs())
    finally:
        serving.close(checkpoint=False)
