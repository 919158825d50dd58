"""Real learner steps on the tiny model: parameters change, the loss moves, the rewarded answer gains; the
entropy bonus, the decoupled objective and the KL penalty do what they say."""

from __future__ import annotations

import math

import pytest
import torch

from agentjet_client.protocol import Trajectory
from agentjet_server.engine.tokens import load_tokenizer
from agentjet_server.learner.batch import build_batch
from agentjet_server.learner.prepare import prepare
from agentjet_server.learner.trainer import Learner, LearnerConfig
from tests.server.learner.groups import _mini, _turn, make_group


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_learner_step_changes_parameters_and_improves_the_rewarded_answer(model_dir, algorithm):
    """GRPO and PPO (critic, GAE, whitening) both raise the rewarded answer on the same groups."""
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    learner = Learner(model, LearnerConfig(lr=2e-3, algorithm=algorithm), pad_id=tok.pad_token_id)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    seven = tok.convert_tokens_to_ids("7")
    losses, probs = [], []
    # AdamW's first steps move every weight by about lr, whatever its gradient: the rewarded answer
    # may dip before it rises, so the test looks at where 16 steps lead (0.09 -> 0.76 GRPO, 0.87 PPO)
    for step in range(16):
        ids, group = make_group(tok, model, "What is 3 + 4?", 7, step)
        with torch.no_grad():
            probs.append(float(torch.softmax(model(input_ids=torch.tensor([ids])).logits[0, -1], -1)[seven]))
        stats = learner.step(build_batch([group], algorithm=algorithm))
        losses.append(stats.loss)
        assert stats.trained_tokens == 20 and stats.grad_norm > 0
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert len(changed) > 0.9 * len(before)
    assert probs[-1] > probs[0] * 4, probs
    assert len({round(x, 9) for x in losses}) > 1  # the loss moved


def rewarded_answer_over_steps(
    model_dir, config: LearnerConfig, estimator: str = "grpo", exact: bool = False
) -> list[float]:  # type: ignore[no-untyped-def]
    """The probability of the rewarded answer before each of 16 steps on fresh groups of the model's own
    answers (``exact``: every sampled log-prob the model's own), every step checked to have a finite loss and a
    gradient."""
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    learner = Learner(model, config, pad_id=tok.pad_token_id)
    seven = tok.convert_tokens_to_ids("7")
    probs = []
    for step in range(16):
        ids, group = make_group(tok, model, "What is 3 + 4?", 7, step, exact)
        with torch.no_grad():
            probs.append(float(torch.softmax(model(input_ids=torch.tensor([ids])).logits[0, -1], -1)[seven]))
        stats = learner.step(build_batch([group], estimator=estimator))  # type: ignore[arg-type]
        assert math.isfinite(stats.loss) and stats.grad_norm > 0
    return probs


@pytest.mark.parametrize("loss", ["gspo", "cispo", "sapo", "importance_sampling", "dro"])
def test_each_policy_loss_raises_the_rewarded_answer(model_dir, loss):
    """Every policy loss of ``--policy-loss`` learns on the same groups as GRPO's clipped ratio does (each with
    the aggregation its reference uses)."""
    aggregation = "seq-mean-token-mean" if loss in ("gspo", "sapo") else "token-mean"
    config = LearnerConfig(lr=2e-3, policy_loss=loss, loss_aggregation=aggregation)  # type: ignore[arg-type]
    probs = rewarded_answer_over_steps(model_dir, config)
    assert probs[-1] > probs[0] * 3, probs


@pytest.mark.parametrize("estimator", ["dr_grpo", "rloo", "reinforce_pp"])
def test_each_group_estimator_raises_the_rewarded_answer(model_dir, estimator):
    """The estimators of ``--advantage`` learn on the same groups as GRPO's does (pass@k rewards a group's best
    answer alone, by its lead: with several right answers there is none, so it is measured in the benchmark)."""
    probs = rewarded_answer_over_steps(model_dir, LearnerConfig(lr=2e-3), estimator)
    assert probs[-1] > probs[0] * 3, probs


def test_entropy_bonus_acts_on_groups_without_reward_signal(model_dir):
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    _, group = make_group(tok, model, "Write two as a digit.", 2, 0)
    flat = [t.model_copy(update={"reward": 0.0}) for t in group]
    assert build_batch([flat]).sequences == []  # plain GRPO: nothing to learn
    batch = build_batch([flat], keep_flat=True)
    assert len(batch.sequences) == 10 and {a for s in batch.sequences for a in s.advantages} == {0.0}
    learner = Learner(model, LearnerConfig(lr=1e-2, entropy_coef=1.0), pad_id=tok.pad_token_id)
    first = learner.step(batch).extra["entropy"]
    for _ in range(3):
        last = learner.step(batch).extra["entropy"]
    assert last > first  # the bonus alone spreads the answer distribution


def test_a_processed_sample_is_corrected_by_pi_over_its_behaviour_probability(model_dir):
    """Tokens the engine sampled with a logit bias and a penalty carry the processed distribution's
    log-probs (not the model's); the decoupled objective recomputes the policy's for them although they
    are of the current version, so the importance weight it applies is pi / mu."""
    import asyncio

    from transformers import AutoModelForCausalLM

    from agentjet_client.protocol import Turn
    from agentjet_server.engine.base import EngineOptions, SamplingParams
    from agentjet_server.engine.hf import TransformersEngine
    from agentjet_server.learner.packing import pack

    engine = TransformersEngine(model_dir, EngineOptions(version=3))
    prompt = engine.render([{"role": "user", "content": "Write seven as a digit."}])
    turns = []
    try:
        for seed in range(4):
            params = SamplingParams(
                max_tokens=4, seed=seed, logit_bias=((20, 4.0), (23, -3.0)), presence_penalty=1.5, top_k=50
            )

            async def sample(p: SamplingParams = params) -> list:
                return [e async for e in engine.generate(prompt, p)]

            events = asyncio.run(sample())
            assert all(e.behaviour is not None for e in events)
            model_lp, behaviour = [e.logprob for e in events], [e.behaviour for e in events]
            assert any(abs(m - b) > 1e-3 for m, b in zip(model_lp, behaviour, strict=True))  # not the model's
            turn = Turn(
                policy_version=3,
                prompt_token_ids=prompt,
                completion_token_ids=[e.token_id for e in events],
                completion_logprobs=behaviour,
                completion_versions=[3] * len(events),
                finish_reason="stop",
                sampled_from="processed",
            )
            turns.append((turn, model_lp))
    finally:
        engine.close()
    episodes = [Trajectory(id=f"p{i}", task_id="t", turns=[t], reward=float(i)) for i, (t, _) in enumerate(turns)]
    batch = build_batch([episodes], version=3)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    learner = Learner(model, LearnerConfig(), pad_id=0)
    [micro] = [p.tensors("cpu") for p in pack(batch.sequences, 4096)]
    prepare(learner, [_mini(micro)], version=3)
    assert bool((micro.versions == -1).all())  # never the current policy's own sample
    # old = mu (what the engine recorded), proximal = pi (the policy's, recomputed): weight pi / mu
    # packing merges siblings that sampled the same tokens after the same prefix: match each packed entry
    # to a sampled token by its behaviour log-prob (equal as recorded), then compare the policy's
    pairs = [(m, b) for t, lps in turns for m, b in zip(lps, t.completion_logprobs, strict=True)]
    for old, prox in zip(micro.old_logprobs.tolist(), micro.proximal_logprobs.tolist(), strict=True):
        pi = [m for m, b in pairs if b == old]
        assert pi and all(abs(prox - m) < 1e-4 for m in pi), (old, prox, pi)
        assert abs(math.exp(prox - old) - math.exp(pi[0] - old)) < 1e-3 * math.exp(pi[0] - old)  # pi / mu
    assert any(abs(m - b) > 1e-3 for m, b in pairs)


def test_kl_to_the_reference_is_zero_at_the_start_and_grows_with_training(model_dir):
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    reference = AutoModelForCausalLM.from_pretrained(model_dir)
    learner = Learner(model, LearnerConfig(lr=2e-3, kl_coef=0.1), pad_id=0, reference=reference)
    kls = []
    for step in range(3):
        _, group = make_group(tok, model, "What is 3 + 4?", 7, step)
        kls.append(learner.step(build_batch([group])).extra["kl_reference"])
    assert kls[0] == 0.0 and kls[-1] > 1e-6
    assert all(not p.requires_grad for p in reference.parameters())
    try:
        Learner(AutoModelForCausalLM.from_pretrained(model_dir), LearnerConfig(kl_coef=0.1), pad_id=0)
    except ValueError as exc:
        assert "reference" in str(exc)
    else:
        raise AssertionError("a KL penalty without a reference model was accepted")


def _own_answers(model, ids: list[int], step: int, count: int = 16) -> list[Trajectory]:
    """``count`` first tokens the model samples after ``ids``, as unrewarded episodes with their log-probs."""
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1], -1)
    tokens = torch.multinomial(logp.exp(), count, replacement=True, generator=torch.Generator().manual_seed(step))
    turns = [_turn(ids, [int(t)], [0]).model_copy(update={"completion_logprobs": [float(logp[t])]}) for t in tokens]
    return [Trajectory(id=f"s{step}-{i}", task_id="t", turns=[turn], reward=0.0) for i, turn in enumerate(turns)]


def test_the_full_distillation_loss_is_the_exact_kl_over_the_vocabulary_and_pulls_faster(model_dir):
    """``distill_loss="full"``: the step's loss is the exact KL(student || teacher) over the vocabulary at each
    trained position (checked on the unpacked sequences), the sampled advantage is not added, and on the
    same samples it pulls the student toward the teacher further than the sampled advantage does."""
    from transformers import AutoModelForCausalLM

    from agentjet_server.learner.objective import objective
    from agentjet_server.learner.packing import pack

    tok = load_tokenizer(model_dir)

    def models() -> tuple[torch.nn.Module, torch.nn.Module]:
        torch.manual_seed(0)
        student, teacher = (AutoModelForCausalLM.from_pretrained(model_dir) for _ in range(2))
        with torch.no_grad():
            teacher.lm_head.weight.add_(0.2 * torch.randn_like(teacher.lm_head.weight))
        return student, teacher

    student, teacher = models()
    learner = Learner(student, LearnerConfig(distill_coef=1.0, distill_loss="full"), pad_id=0, teacher=teacher)
    _, group = make_group(tok, student, "Write two as a digit.", 2, 0)
    batch = build_batch([[t.model_copy(update={"reward": 0.0}) for t in group]], keep_flat=True)
    [micro] = [p.tensors("cpu") for p in pack(batch.sequences, 4096)]
    prepare(learner, [_mini(micro)], version=None, tokens=float(micro.entries))
    assert float(micro.advantages.abs().max()) == 0.0  # no sampled advantage: the loss term carries it
    loss, stats = objective(learner.config, learner.policy, micro, float(micro.entries), "rl", learner.teacher)
    expected = []
    with torch.no_grad():
        for sequence in batch.sequences:
            ids = torch.tensor([sequence.tokens])
            s, t = (torch.log_softmax(m(input_ids=ids).logits[0].float(), -1) for m in (student, teacher))
            expected += [float((s[p - 1].exp() * (s[p - 1] - t[p - 1])).sum()) for p in sequence.positions]
    assert float(loss.detach()) == pytest.approx(sum(expected) / len(expected), rel=1e-4)
    assert stats["teacher_kl_exact"] == pytest.approx(sum(expected) / len(expected), rel=1e-4)

    ids = group[0].turns[0].prompt_token_ids
    finals = {}
    for mode in ("sampled", "full"):  # the same budget of the student's own samples, each loss
        student, teacher = models()
        config = LearnerConfig(lr=1e-2, distill_coef=1.0, distill_loss=mode)
        learner = Learner(student, config, pad_id=0, teacher=teacher)
        for step in range(6):
            learner.step(build_batch([_own_answers(student, ids, step)], keep_flat=True))
        with torch.no_grad():
            s, t = (torch.log_softmax(m(input_ids=torch.tensor([ids])).logits[0, -1], -1) for m in (student, teacher))
        finals[mode] = float((s.exp() * (s - t)).sum())
    assert finals["full"] < finals["sampled"], finals
    with pytest.raises(ValueError, match="a local teacher"):
        Learner(AutoModelForCausalLM.from_pretrained(model_dir), LearnerConfig(distill_loss="full"), pad_id=0)
