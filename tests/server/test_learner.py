"""A real GRPO step on the tiny model: parameters change, the loss moves, the right answer gains."""

import torch

from agentjet_client.protocol import Trajectory, Turn
from agentjet_server.engine.tokens import load_tokenizer
from agentjet_server.learner.trainer import Learner, LearnerConfig, build_batch


def make_group(tok, model, prompt, right, step):
    ids = tok.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    end = tok.convert_tokens_to_ids("<|im_end|>")
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1], -1)
    group = []
    for d in range(10):
        tid = tok.convert_tokens_to_ids(str(d))
        turn = Turn(
            policy_version=0,
            prompt_token_ids=ids,
            completion_token_ids=[tid, end],
            completion_logprobs=[float(logp[tid]), -1e-3],
            finish_reason="stop",
        )
        group.append(Trajectory(id=f"{step}-{d}", task_id=prompt, turns=[turn], reward=float(d == right)))
    return ids, group


def test_build_batch_skips_groups_without_signal_and_failed_episodes(model_dir):
    tok = load_tokenizer(model_dir)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    _, group = make_group(tok, model, "What is 1 + 2?", 3, 0)
    flat = [t.model_copy(update={"reward": 1.0}) for t in group]
    assert build_batch([flat]).sequences == []
    failed = [t.model_copy(update={"status": "failed"}) for t in group[:9]] + group[9:]
    batch = build_batch([failed])
    assert batch.skipped_groups == 1 and batch.trajectories == 10


def test_learner_step_changes_parameters_and_improves_the_rewarded_answer(model_dir):
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    learner = Learner(model, LearnerConfig(lr=2e-3), pad_id=tok.pad_token_id)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    seven = tok.convert_tokens_to_ids("7")
    losses, probs = [], []
    for step in range(4):
        ids, group = make_group(tok, model, "What is 3 + 4?", 7, step)
        with torch.no_grad():
            probs.append(float(torch.softmax(model(input_ids=torch.tensor([ids])).logits[0, -1], -1)[seven]))
        stats = learner.step(build_batch([group]))
        losses.append(stats.loss)
        assert stats.trained_tokens == 20 and stats.grad_norm > 0
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert len(changed) > 0.9 * len(before)
    assert probs[-1] > probs[0] * 2
    assert len({round(x, 9) for x in losses}) > 1  # the loss moved


def test_head_on_trained_positions_only_equals_full_logits(model_dir):
    """The learner runs the output head only where tokens are trained; values must be identical."""
    import random

    from transformers import AutoModelForCausalLM

    from agentjet_server.learner.packing import Sequence, pack

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    learner = Learner(model, LearnerConfig(), pad_id=0)
    rng = random.Random(0)
    for _ in range(6):
        tokens = [rng.randrange(1000) for _ in range(rng.randint(5, 30))]
        start = rng.randint(1, len(tokens) - 1)
        [packed] = pack([Sequence.single(tokens, start, [-1.0] * (len(tokens) - start), 1.0)], 4096)
        batch = packed.tensors(torch.device("cpu"))
        with torch.no_grad():
            fast, entropy = learner.sequence_logprobs(batch)
            full_logp = torch.log_softmax(model(input_ids=torch.tensor([tokens])).logits[0, start - 1 : -1], -1)
            full = full_logp.gather(-1, torch.tensor(tokens[start:]).unsqueeze(-1)).squeeze(-1)
            full_entropy = -(full_logp.exp() * full_logp).sum(-1)
        assert torch.allclose(fast, full, atol=1e-6)
        assert torch.allclose(entropy, full_entropy, atol=1e-5)


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
