"""Prefix-tree packing against the naive computation: every sequence alone, no packing.

Random forests of sequences (shared prefixes at random depths, duplicates, sequences that are
prefixes of others, several roots), random trained positions: the packed per-token log-probs
and the gradients of a loss over them must equal the unpacked ones within 1e-5 (fp32, CPU).
"""

from __future__ import annotations

import random

import pytest
import torch

from agentjet_server.learner.batch import Sequence
from agentjet_server.learner.packing import Packed, pack, unique_tokens
from agentjet_server.learner.trainer import Learner, LearnerConfig


def random_forest(rng: random.Random, vocab: int, count: int) -> list[Sequence]:
    roots = [[rng.randrange(vocab) for _ in range(rng.randint(1, 6))] for _ in range(rng.randint(1, 3))]
    token_lists: list[list[int]] = []
    for _ in range(count):
        if token_lists and rng.random() < 0.7:  # branch off an earlier sequence somewhere along it
            base = rng.choice(token_lists)
            tokens = base[: rng.randint(1, len(base))]
            if rng.random() < 0.15:
                tokens = list(base)  # a duplicate (GRPO siblings that sampled the same thing)
        else:
            tokens = list(rng.choice(roots))
        tokens = tokens + [rng.randrange(vocab) for _ in range(rng.randint(0, 12))]
        if len(tokens) < 2:
            tokens.append(rng.randrange(vocab))
        token_lists.append(tokens)
    out = []
    for tokens in token_lists:
        positions = sorted(rng.sample(range(1, len(tokens)), rng.randint(1, len(tokens) - 1)))
        old = [-rng.uniform(2, 8) for _ in positions]
        adv = [rng.uniform(-1.5, 1.5) for _ in positions]
        out.append(Sequence(tokens, positions, old, adv))
    return out


def naive(model: torch.nn.Module, sequences: list[Sequence]) -> list[torch.Tensor]:
    """Each sequence on its own: log-prob of every trained token, in the sequence's order."""
    out = []
    for seq in sequences:
        logits = model(input_ids=torch.tensor([seq.tokens])).logits[0]
        logp = torch.log_softmax(logits.float(), -1)
        idx = torch.tensor(seq.positions)
        out.append(logp[idx - 1].gather(-1, torch.tensor(seq.tokens)[idx].unsqueeze(-1)).squeeze(-1))
    return out


def objective(logprobs: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, total: int) -> torch.Tensor:
    """The learner's surrogate (unclipped), as a mean over the batch's ``total`` trained tokens."""
    return -(torch.exp(logprobs - old) * adv).sum() / total


@pytest.fixture(scope="module")
def model(model_dir):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


@pytest.mark.parametrize("mode", ["dense", "segments"])
@pytest.mark.parametrize("seed", range(6))
def test_packed_logprobs_and_gradients_equal_unpacked(model, seed, mode):
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    sequences = random_forest(rng, vocab, rng.randint(3, 14))
    budget = rng.choice([4096, 24])  # one tree, or trees split across micro-batches
    learner = Learner(model, LearnerConfig(), pad_id=0)
    with torch.no_grad():  # behaviour log-probs near the policy's, as in training (ratios near 1)
        for seq, values in zip(sequences, naive(model, sequences), strict=True):
            seq.old_logprobs = [v + rng.uniform(-0.2, 0.2) for v in values.tolist()]

    model.zero_grad()
    reference = naive(model, sequences)
    old = torch.tensor([o for s in sequences for o in s.old_logprobs])
    adv = torch.tensor([a for s in sequences for a in s.advantages])
    objective(torch.cat(reference), old, adv, len(old)).backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    # entries in packed order, keyed back to (sequence, position) to compare one by one
    expected = {}
    for i, seq in enumerate(sequences):
        for j, (p, value) in enumerate(zip(seq.positions, reference[i].tolist(), strict=True)):
            expected.setdefault((tuple(seq.tokens[: p + 1]), seq.old_logprobs[j], seq.advantages[j]), value)

    model.zero_grad()
    packed = pack(sequences, budget)
    total = torch.zeros(())
    worst = 0.0
    for micro in packed:
        batch = micro.tensors(torch.device("cpu"), mode)
        logprobs, _ = learner.sequence_logprobs(batch)
        total = total + objective(logprobs, batch.old_logprobs, batch.advantages, len(old))
        for e, value in enumerate(logprobs.tolist()):
            path = (*_path(micro, micro.entry_nodes[e]), micro.entry_targets[e])
            key = (path, micro.old_logprobs[e], micro.advantages[e])
            worst = max(worst, abs(value - expected[key]))
    total.backward()
    assert sum(len(m.entry_nodes) for m in packed) == sum(len(s.positions) for s in sequences)
    assert worst <= 1e-5, f"packed log-probs differ by {worst}"
    grad_diff = max(float((p.grad - want_grads[n]).abs().max()) for n, p in model.named_parameters())
    scale = max(float(g.abs().max()) for g in want_grads.values())
    print(f"packing {mode} seed {seed}: max |dlogp| {worst:.2g}, max |dgrad| {grad_diff:.2g} of {scale:.2g}")
    # float32 summation order differs between the packed and the per-sequence passes (and between
    # CPUs' kernels): relative to the largest gradient, as a wrong mask or position would not be
    assert grad_diff <= 1e-5 * max(1.0, scale), f"packed gradients differ by {grad_diff} (largest gradient {scale})"
    assert max(float(g.abs().max()) for g in want_grads.values()) > 1e-3  # real gradients
    processed = sum(m.size for m in packed)
    floor = unique_tokens([s.tokens for s in sequences])
    assert processed >= floor and (budget < 100 or processed == floor)
    assert processed < sum(len(s.tokens) for s in sequences) or len(sequences) == 1


def _path(micro: Packed, node: int) -> tuple[int, ...]:
    tokens = []
    while node >= 0:
        tokens.append(micro.tokens[node])
        node = micro.parents[node]
    return tuple(reversed(tokens))


def test_tree_mask_sees_exactly_the_ancestors():
    micro = Packed()
    for tokens in sorted([[1, 2, 3], [1, 2, 4, 5], [1, 6], [7, 8]]):
        micro.insert(Sequence(tokens, [], [], []))
    assert micro.tokens == [1, 2, 3, 4, 5, 6, 7, 8] and micro.depth == [0, 1, 2, 2, 3, 1, 0, 1]
    mask = micro.attention_mask()
    assert mask is not None
    allowed = {i: [j for j in range(micro.size) if mask[0, 0, i, j]] for i in range(micro.size)}
    assert allowed == {0: [0], 1: [0, 1], 2: [0, 1, 2], 3: [0, 1, 3], 4: [0, 1, 3, 4], 5: [0, 5], 6: [6], 7: [6, 7]}
    assert micro.segments() == [(0, 1, -1), (1, 2, 0), (2, 3, 1), (3, 5, 1), (5, 6, 0), (6, 8, -1)]
    chain = Packed()
    chain.insert(Sequence([1, 2, 3], [1, 2], [-1.0, -1.0], [1.0, 1.0]))
    chain.insert(Sequence([1, 2], [1], [-1.0], [0.5]))  # a prefix of the other: no new node
    assert chain.size == 3 and chain.attention_mask() is None and chain.entry_nodes == [0, 1, 0]


def test_a_sequence_longer_than_the_budget_gets_a_micro_batch_of_its_own():
    long = Sequence.single(list(range(50)), 10, [-1.0] * 40, 1.0)
    short = Sequence.single([100, 101, 102], 1, [-1.0] * 2, 1.0)
    packed = pack([long, short], budget=20)
    assert sorted(p.size for p in packed) == [3, 50]
