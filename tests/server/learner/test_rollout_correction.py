"""Rollout correction against the sampler's log-probs (``--token-mask``, ``--sequence-mask``, ``--sequence-is``,
``--mismatch-kl-coef``) and the mismatch figures: the masks and weights against per-token loops written from
their definitions, on hand-made tensors; then real steps of the tiny model, whose figures are checked against a
forward pass of its own."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from agentjet_server.engine.tokens import load_tokenizer
from agentjet_server.learner.batch import build_batch
from agentjet_server.learner.config import LearnerConfig
from agentjet_server.learner.distributed import DistContext
from agentjet_server.learner.objective import importance_weight, mismatch_figures, policy_terms, rollout_masks
from agentjet_server.learner.packing import MicroBatch
from agentjet_server.learner.trainer import Learner
from tests.server.learner.groups import make_group, micro_batch
from tests.server.learner.test_trainer import rewarded_answer_over_steps

SPANS = [(0, 4), (4, 7)]  # two sequences: 4 trained tokens, then 3
TRAINER = torch.tensor([-1.0, -0.5, -2.0, -0.1, -1.2, -0.3, -0.7])  # pi_old
SAMPLER = torch.tensor([-1.0, -1.8, -2.1, -0.1, -1.25, -0.3, -0.6])  # mu: token 1 far below, the rest near


def _part(logprobs: torch.Tensor, advantages: torch.Tensor) -> MicroBatch:
    """The two sequences with the trainer's and the sampler's log-probs; the proximal ones are the sampled ones
    reused (decoupled's shortcut for tokens the current version sampled)."""
    return micro_batch(SAMPLER.clone(), advantages, None, SPANS, SAMPLER.clone(), TRAINER.clone())


def test_the_masks_leave_out_what_their_definitions_say_and_count_it():
    config = LearnerConfig(token_mask=(0.5, 2.0), sequence_mask=(0.9, 1.1))
    keep, stats = rollout_masks(TRAINER - SAMPLER, torch.ones(7), SPANS, config)
    ratios = [math.exp(t - s) for t, s in zip(TRAINER.tolist(), SAMPLER.tolist(), strict=True)]
    token_keep = [0.5 <= r <= 2.0 for r in ratios]  # token 1: exp(1.3) = 3.7 is out
    geo = [math.exp(sum(math.log(r) for r in ratios[a:b]) / (b - a)) for a, b in SPANS]  # 1.43, 1.0
    sequence_keep = [0.9 <= geo[0] <= 1.1] * 4 + [0.9 <= geo[1] <= 1.1] * 3
    assert keep.tolist() == [float(a and b) for a, b in zip(token_keep, sequence_keep, strict=True)]
    assert keep.tolist() == [0.0] * 4 + [1.0] * 3
    assert stats == pytest.approx({"token_masked": 1 / 7, "sequence_masked": 4 / 7})


def test_a_masked_token_and_a_masked_sequence_contribute_no_gradient_and_the_rest_is_untouched():
    advantages = torch.tensor([0.5, 0.5, 0.5, 0.5, -0.4, -0.4, -0.4])
    logprobs = TRAINER.clone().requires_grad_(True)
    wide = {"off_policy": "none", "clip_high": 10.0}  # the ratio itself: no token is clipped
    plain = LearnerConfig(**wide)  # type: ignore[arg-type]
    masked = LearnerConfig(token_mask=(0.5, 2.0), **wide)  # type: ignore[arg-type]
    whole = LearnerConfig(sequence_mask=(0.9, 1.1), **wide)  # type: ignore[arg-type]
    grads = {}
    for name, config in [("plain", plain), ("token", masked), ("sequence", whole)]:
        per_token, _ = policy_terms(config, logprobs, _part(logprobs, advantages))
        (grads[name],) = torch.autograd.grad(per_token.sum(), logprobs)
    assert grads["plain"].abs().min() > 0
    assert grads["token"][1] == 0 and torch.equal(
        grads["token"][[0, 2, 3, 4, 5, 6]], grads["plain"][[0, 2, 3, 4, 5, 6]]
    )
    assert grads["sequence"][:4].abs().max() == 0 and torch.equal(grads["sequence"][4:], grads["plain"][4:])


def test_the_sequence_weight_is_the_truncated_product_on_every_token_and_moves_with_any_one_of_them():
    weight, stats = importance_weight(TRAINER - SAMPLER, 2.0, torch.ones(7), SPANS)
    products = [math.exp(sum(TRAINER[a:b].tolist()) - sum(SAMPLER[a:b].tolist())) for a, b in SPANS]
    assert weight.tolist() == pytest.approx([min(products[0], 2.0)] * 4 + [min(products[1], 2.0)] * 3, rel=1e-6)
    assert stats["is_truncated_fraction"] == pytest.approx(4 / 7)  # the first sequence's product is 3.9
    moved_sampler = SAMPLER.clone()
    moved_sampler[5] -= 0.2
    moved, _ = importance_weight(TRAINER - moved_sampler, 2.0, torch.ones(7), SPANS)
    assert torch.equal(moved[:4], weight[:4]) and (moved[4:] - weight[4:]).abs().min() > 1e-3
    # a thousand-token sequence far off the sampler: truncated, never an overflow
    far, _ = importance_weight(torch.full((1000,), 0.9), 2.0, torch.ones(1000), [(0, 1000)])
    assert far.tolist() == [2.0] * 1000


def test_with_rollout_correction_the_decoupled_ratio_is_taken_against_the_trainer_not_the_reused_sample():
    """Decoupled reuses the sampled log-probs as pi_prox for tokens the current version sampled (trainer and
    sampler assumed equal); with any correction on, pi_old is the trainer's own, and the weight is pi_old / mu."""
    advantages = torch.full((7,), 0.5)
    logprobs = TRAINER.clone().requires_grad_(True)
    per_token, stats = policy_terms(LearnerConfig(mismatch_kl_coef=0.1), logprobs, _part(logprobs, advantages))
    expected_weight = torch.clamp(torch.exp(TRAINER - SAMPLER), max=2.0)
    assert per_token.tolist() == pytest.approx((-expected_weight * 0.5).tolist(), rel=1e-6)  # the ratio is 1
    assert stats["is_weight_mean"] == pytest.approx(float(expected_weight.mean()), rel=1e-6)
    reused, _ = policy_terms(LearnerConfig(), logprobs, _part(logprobs, advantages))
    assert reused.tolist() != per_token.tolist()


def test_the_mismatch_figures_are_the_quantiles_kl_and_correlation_of_the_two_log_probs():
    part = _part(TRAINER, torch.zeros(7))
    figures = mismatch_figures([part], DistContext())
    log_ratio = (TRAINER - SAMPLER).double()
    q = torch.quantile(log_ratio, torch.tensor([0.01, 0.5, 0.99], dtype=torch.float64)).exp().tolist()
    geo = [math.exp(float(log_ratio[a:b].mean())) for a, b in SPANS]
    corr = float(torch.corrcoef(torch.stack([TRAINER, SAMPLER]).double())[0, 1])
    kl = float((torch.exp(-log_ratio) + log_ratio - 1).mean())  # k3 of KL(mu || pi_old), samples from mu
    assert figures["mismatch_tokens"] == 7
    assert [figures[f"mismatch_token_p{p}"] for p in ("01", "50", "99")] == pytest.approx(q, rel=1e-6)
    # the median of two sequences' log-ratios is their mean (the quantiles are taken of the logs)
    assert figures["mismatch_sequence_p50"] == pytest.approx(math.sqrt(geo[0] * geo[1]), rel=1e-6)
    assert figures["mismatch_kl"] == pytest.approx(kl, rel=1e-6) and kl > 0
    assert figures["mismatch_logprob_corr"] == pytest.approx(corr, rel=1e-6)
    assert mismatch_figures([dataclasses.replace(part, trainer_logprobs=None)], DistContext()) == {}


def _steps(model_dir, config: LearnerConfig, offsets: list[float]) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """The figures of one step of the tiny model on a group of its ten digit answers, whose sampled log-probs
    are the model's own except each end token's, lower by ``offsets[n]`` (as another kernel's would be)."""
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    learner = Learner(model, config, pad_id=tok.pad_token_id)
    _, group = make_group(tok, model, "What is 3 + 4?", 7, 0, exact=True)
    shifted = []
    for offset, trajectory in zip(offsets, group, strict=True):
        turn = trajectory.turns[0]
        logprobs = [turn.completion_logprobs[0], turn.completion_logprobs[1] - offset]
        shifted.append(
            trajectory.model_copy(update={"turns": [turn.model_copy(update={"completion_logprobs": logprobs})]})
        )
    return learner.step(build_batch([shifted])).extra


def test_a_step_measures_the_mismatch_from_its_first_forward_or_its_prepare_pass_alike(model_dir):
    """One mini-batch: pi_old is the update's first forward (no extra pass); two mini-batches with a
    correction on: the prepare pass gives it for every token, and the figures are the same; two without a
    pass before the update: the first mini-batch's tokens only."""
    offsets = [0.05 * n for n in range(10)]
    one = _steps(model_dir, LearnerConfig(lr=1e-3), offsets)
    assert one["mismatch_tokens"] == 20
    log_ratio = torch.tensor([v for offset in offsets for v in (0.0, offset)], dtype=torch.float64)
    expected = torch.quantile(log_ratio, torch.tensor([0.01, 0.5, 0.99], dtype=torch.float64)).exp().tolist()
    assert [one[f"mismatch_token_p{p}"] for p in ("01", "50", "99")] == pytest.approx(expected, abs=1e-4)
    geo = sorted(math.exp(offset / 2) for offset in offsets)
    assert one["mismatch_sequence_p50"] == pytest.approx(math.sqrt(geo[4] * geo[5]), abs=1e-4)
    kl = float((torch.exp(-log_ratio) + log_ratio - 1).mean())
    assert one["mismatch_kl"] == pytest.approx(kl, rel=1e-3) and one["mismatch_logprob_corr"] > 0.99
    corrected = _steps(model_dir, LearnerConfig(lr=1e-3, mini_batches=2, token_mask=(0.0, 1e9)), offsets)
    assert corrected["mismatch_tokens"] == 20 and corrected["token_masked"] == 0
    assert corrected["mismatch_kl"] == pytest.approx(one["mismatch_kl"], rel=1e-4)
    # no pass before the update (nothing needs a proximal log-prob): the first mini-batch's forward only
    sampled_only = _steps(model_dir, LearnerConfig(lr=1e-3, mini_batches=2, off_policy="none"), offsets)
    assert 0 < sampled_only["mismatch_tokens"] < 20


def test_a_tight_token_mask_leaves_out_the_tokens_the_sampler_got_wrong(model_dir):
    figures = _steps(model_dir, LearnerConfig(lr=1e-3, token_mask=(0.9, 1.1)), [0.3] * 10)
    assert figures["token_masked"] == pytest.approx(0.5)  # every end token: pi_old / mu = exp(0.3) = 1.35
    assert figures["mismatch_token_p99"] == pytest.approx(math.exp(0.3), rel=1e-3)
    # a sequence mask: each sequence's geometric mean is exp(0.3 / 2) = 1.16, outside 0.9-1.1, inside 0.9-1.2
    figures = _steps(model_dir, LearnerConfig(lr=1e-3, sequence_mask=(0.9, 1.1)), [0.3] * 10)
    assert figures["sequence_masked"] == 1
    figures = _steps(model_dir, LearnerConfig(lr=1e-3, sequence_mask=(0.9, 1.2)), [0.3] * 10)
    assert figures["sequence_masked"] == 0


@pytest.mark.parametrize(
    "correction",
    [{"token_mask": (0.5, 2.0)}, {"sequence_mask": (0.5, 2.0)}, {"sequence_is": True}, {"mismatch_kl_coef": 0.1}],
    ids=["token-mask", "sequence-mask", "sequence-is", "mismatch-kl"],
)
def test_each_correction_still_raises_the_rewarded_answer(model_dir, correction):
    """With the sampler's log-probs the model's own (pi_old / mu = 1 up to rounding: nothing is masked), each
    correction leaves the update what it was: the rewarded answer gains as without one."""
    probs = rewarded_answer_over_steps(model_dir, LearnerConfig(lr=2e-3, **correction), exact=True)
    assert probs[-1] > probs[0] * 4, probs
