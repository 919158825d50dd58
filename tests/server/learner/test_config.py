"""Every field of the learner's settings (``learner.config.LearnerConfig``) comes from a server setting that sets
it, apart from a named few that only a library user sets: a new field that no flag reaches fails here."""

from __future__ import annotations

import dataclasses

from agentjet_server.control import learner_config
from agentjet_server.engine.adapter import LoraSpec
from agentjet_server.learner.config import LearnerConfig
from agentjet_server.settings import ServerSettings

# field: (the server setting that sets it, a value other than the default, the field's value then)
FROM_SETTINGS = {
    "lr": ("lr", 0.5, 0.5),
    "clip_low": ("clip_low", 0.1, 0.1),
    "clip_high": ("clip_high", 0.4, 0.4),
    "max_grad_norm": ("max_grad_norm", 3.0, 3.0),
    "entropy_coef": ("entropy_coef", 0.01, 0.01),
    "algorithm": ("algorithm", "ppo", "ppo"),
    "off_policy": ("off_policy", "tis", "tis"),
    "is_cap": ("is_cap", 5.0, 5.0),
    "policy_loss": ("policy_loss", "gspo", "gspo"),
    "advantage": ("advantage", "rloo", "rloo"),
    "mask_truncated": ("mask_truncated", True, True),
    "overlong_buffer": ("overlong_buffer", 64, 64),
    "cispo_cap": ("cispo_cap", 3.0, 3.0),
    "sapo_tau_pos": ("sapo_tau_pos", 2.0, 2.0),
    "sapo_tau_neg": ("sapo_tau_neg", 2.0, 2.0),
    "dro_beta": ("dro_beta", 0.5, 0.5),
    "loss_aggregation": ("loss_aggregation", "seq-mean-token-mean", "seq-mean-token-mean"),
    "loss_norm_length": ("loss_norm_length", 64, 64),
    "kl_coef": ("kl_coef", 0.2, 0.2),
    "token_mask": ("token_mask", "0.5,5", (0.5, 5.0)),
    "sequence_mask": ("sequence_mask", "0.9,1.1", (0.9, 1.1)),
    "sequence_is": ("sequence_is", True, True),
    "mismatch_kl_coef": ("mismatch_kl_coef", 0.1, 0.1),
    "mini_batches": ("mini_batches", 4, 4),
    "gamma": ("gamma", 0.9, 0.9),
    "lam": ("lam", 0.5, 0.5),
    "vf_coef": ("vf_coef", 2.0, 2.0),
    "advantage_norm": ("advantage_norm", "batch", "batch"),
    "compute_dtype": ("learner_dtype", "bfloat16", "bfloat16"),
    "gradient_checkpointing": ("gradient_checkpointing", True, True),
    "cpu_offload": ("cpu_offload", True, True),
    "micro_batch_tokens": ("micro_batch_tokens", 512, 512),
    "lora": ("lora_rank", 4, LoraSpec(rank=4, alpha=8.0)),
}
TEACHER = "<a model dir>"  # the test gives the embedded model's
# set with another setting: distillation's weight needs --teacher, an adapter per agent needs LoRA
TOGETHER = {
    "distill_coef": {"teacher": TEACHER, "distill_coef": 0.3},
    "distill_loss": {"teacher": TEACHER, "distill_coef": 0.3, "distill_loss": "full"},
    "adapters": {"lora_rank": 4, "adapters": "planner,executor"},
    "overlong_penalty": {"overlong_buffer": 64, "overlong_penalty": 0.5},
}
LIBRARY_ONLY = {"weight_decay", "epochs", "value_clip", "tree_attention"}  # no flag: the library's defaults


def test_each_learner_field_is_set_by_its_server_setting_or_named_as_the_librarys(model_dir):
    fields = {f.name for f in dataclasses.fields(LearnerConfig)}
    assert fields == set(FROM_SETTINGS) | set(TOGETHER) | LIBRARY_ONLY
    default = learner_config(ServerSettings())
    for name, (setting, value, expected) in FROM_SETTINGS.items():
        config = learner_config(ServerSettings.model_validate({setting: value}))
        got = getattr(config, name)
        if isinstance(expected, LoraSpec):
            assert (got.rank, got.alpha) == (expected.rank, expected.alpha), name
        else:
            assert got == expected != getattr(default, name), name
    for name, settings in TOGETHER.items():
        teacher = {"teacher": str(model_dir)} if "teacher" in settings else {}
        config = learner_config(ServerSettings.model_validate({**settings, **teacher}))
        assert getattr(config, name) != getattr(default, name), name
    for name in LIBRARY_ONLY:  # the server leaves them as they are
        assert getattr(default, name) == getattr(LearnerConfig(), name)


def test_tis_with_another_policy_loss_is_refused_at_start_and_as_a_live_change():
    """--off-policy tis is a loss of its own: with gspo (or any loss but ppo) the server does not start, and a
    running server refuses the change with a 400 that names the valid combinations."""
    import pytest

    from agentjet_server.control import check_changes
    from agentjet_server.errors import InvalidRequestError

    with pytest.raises(ValueError, match="--off-policy tis is a policy loss of its own"):
        ServerSettings(policy_loss="gspo", off_policy="tis")
    running = ServerSettings(policy_loss="gspo")
    with pytest.raises(InvalidRequestError, match="use --off-policy decoupled or none with gspo") as refused:
        check_changes(running, {"off_policy": "tis"})
    assert refused.value.status_code == 400
    assert check_changes(running, {"policy_loss": "cispo"}).policy_loss == "cispo"  # live, from the next step


def test_an_estimator_with_the_wrong_algorithm_is_refused_and_ppo_defaults_to_gae():
    import pytest

    with pytest.raises(ValueError, match="--advantage gae goes with --algorithm ppo"):
        ServerSettings(advantage="gae")
    with pytest.raises(ValueError, match="--advantage rloo goes with --algorithm grpo"):
        ServerSettings(advantage="rloo", algorithm="ppo")
    assert learner_config(ServerSettings(algorithm="ppo")).advantage == "gae"
    assert learner_config(ServerSettings()).advantage == "grpo"


def test_rollout_correction_refuses_what_does_not_compose_and_bounds_that_miss_the_ratio_one():
    """A sequence weight replaces decoupled's token weight (so it needs decoupled, at start and live); mask
    bounds must hold 1 between them and come as LOW,HIGH, from the flag's text or the job file's list."""
    import pytest

    from agentjet_server.control import check_changes
    from agentjet_server.errors import InvalidRequestError
    from agentjet_server.learner.objective import corrects_rollout

    with pytest.raises(ValueError, match="set --overlong-buffer too"):
        ServerSettings(overlong_penalty=0.5)
    with pytest.raises(ValueError, match="--sequence-is takes decoupled's importance weight per sequence"):
        ServerSettings(sequence_is=True, off_policy="none")
    with pytest.raises(InvalidRequestError, match="use --token-mask or --sequence-mask") as refused:
        check_changes(ServerSettings(sequence_is=True), {"off_policy": "tis"})
    assert refused.value.status_code == 400
    for bad, reason in [("2,5", "must hold the ratio 1"), ("0.5", "is not LOW,HIGH"), ("0.5,inf", "must hold")]:
        with pytest.raises(ValueError, match=reason):
            ServerSettings.model_validate({"token_mask": bad})
    assert ServerSettings.model_validate({"sequence_mask": [0.99, 1.01]}).sequence_mask == (0.99, 1.01)
    live = check_changes(ServerSettings(), {"token_mask": "0,4", "off_policy": "none"})
    assert learner_config(live).token_mask == (0.0, 4.0) and corrects_rollout(learner_config(live))
    assert not corrects_rollout(learner_config(ServerSettings()))
