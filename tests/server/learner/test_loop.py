"""The objective on the real runtime (learner thread, tiny model): staleness measured again when a
batch is built, and the KL penalty against the frozen initial weights.

Trajectories sampled at version 0 are all accepted under ``max_staleness=1``; pushed at once, the
buffer holds three batches. Batch 1 trains at version 0, batch 2 at version 1 (lag 1, within the
bound), batch 3 at version 2 (lag 2): past the bound by the time it is trained.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.server.state.runs import GROUP, GROUPS, make_trajectories, push, runtime, wait_for


@pytest.mark.parametrize("policy", ["drop", "downweight"])
def test_a_batch_past_the_bound_by_training_time_is_dropped_or_downweighted(model_dir: Path, tmp_path, policy):
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    trajectories = make_trajectories(vocab, 3)
    rt = runtime(model_dir, tmp_path / "state", checkpoint_every=0, max_staleness=1, stale_policy=policy)
    try:
        assert push(rt, trajectories) == ["accepted"] * len(trajectories)  # lag 0 when they arrive
        wait_for(lambda: rt.store.trained == len(trajectories), "all three batches taken")
        learner = rt.status().learner
    finally:
        rt.close()
    per_batch = GROUP * GROUPS
    assert learner.stale_policy == policy
    if policy == "drop":
        assert learner.stale_at_training == per_batch and learner.downweighted_tokens == 0
        assert learner.step == 2 and learner.skipped_batches == 1  # nothing of batch 3 was trained
        assert set(learner.trained_token_lag) == {"0", "1"}
    else:
        assert learner.stale_at_training == 0 and learner.downweighted_tokens > 0
        assert learner.step == 3
        assert set(learner.trained_token_lag) == {"0", "1", "2"}
    # every sampled token of the trained batches is in the histogram
    tokens = sum(len(t.turns[0].completion_token_ids) for t in trajectories)
    trained = (
        tokens
        if policy == "downweight"
        else tokens - sum(len(t.turns[0].completion_token_ids) for t in trajectories[-per_batch:])
    )
    assert sum(learner.trained_token_lag.values()) == trained


def test_a_kl_penalty_runs_against_the_initial_weights_and_is_reported(model_dir: Path, tmp_path):
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    trajectories = make_trajectories(vocab, 2)
    rt = runtime(model_dir, tmp_path / "state", checkpoint_every=0, kl_coef=0.1)
    try:
        reference = rt.loop.learner.reference
        assert reference is not None
        before = {k: v.clone() for k, v in reference.state_dict().items()}
        push(rt, trajectories)
        wait_for(lambda: rt.loop.learner.steps == 2 and rt.version == 2, "two steps")
        lines = rt.telemetry.history.since(0, {"step"}, limit=10)
    finally:
        rt.close()
    assert [line["step"] for line in lines] == [1, 2]
    assert lines[0]["kl_reference"] == 0.0 < lines[1]["kl_reference"]  # the first step starts at the reference
    assert all(torch.equal(v, before[k]) for k, v in reference.state_dict().items())  # frozen


def test_a_reference_with_another_vocabulary_is_refused(model_dir: Path, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from agentjet_server.errors import ConfigError

    config = AutoConfig.from_pretrained(model_dir)
    config.vocab_size += 8
    other = tmp_path / "other"
    AutoModelForCausalLM.from_config(config).save_pretrained(other)
    with pytest.raises(ConfigError, match="same tokenizer"):
        runtime(model_dir, tmp_path / "state", kl_coef=0.1, reference=other)
