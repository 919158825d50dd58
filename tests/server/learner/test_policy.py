"""The policy as the learner sees it (``learner.policy``): each trained token's log-probability and the
entropy there, read at the node that predicts it, against a naive softmax on a hand-made logit table; the
output head run only where tokens are trained (the real tiny model); the critic's value head, which starts
at zero, reads the policy's last hidden state and trains apart from the policy."""

from __future__ import annotations

import math
import random

import pytest
import torch
from transformers.modeling_outputs import CausalLMOutput

from agentjet_server.learner.batch import Sequence
from agentjet_server.learner.packing import MicroBatch, pack
from agentjet_server.learner.policy import PolicyModel
from agentjet_server.learner.trainer import Learner, LearnerConfig

# five nodes of a prefix tree over a vocabulary of five: row i is what node i predicts
LOGITS = [
    [0.5, -1.0, 2.0, 0.0, 0.25],
    [1.5, 1.5, -0.5, 3.0, -2.0],
    [-1.0, 0.0, 1.0, 2.0, 4.0],
    [0.0, 0.0, 0.0, 0.0, 0.0],
    [2.5, -3.0, 0.5, 1.0, -0.75],
]


class Table(torch.nn.Module):
    """A causal "model" that is not a Hugging Face one: its logits are the table, one row per node."""

    def __init__(self) -> None:
        super().__init__()
        self.logits = torch.nn.Parameter(torch.tensor(LOGITS))

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: object) -> CausalLMOutput:
        assert input_ids.shape == (1, len(LOGITS))
        return CausalLMOutput(logits=self.logits[None])


def siblings() -> MicroBatch:
    """Two sequences sharing the prefix [0, 1]: nodes 0 -> 1 -> 2 -> 3 and 1 -> 4."""
    first = Sequence([0, 1, 2, 3], [2, 3], [-1.0, -1.0], [1.0, 1.0])  # trains 2 (read at node 1), 3 (at node 2)
    second = Sequence([0, 1, 4], [1, 2], [-1.0, -1.0], [1.0, 1.0])  # trains 1 (at node 0), 4 (at node 1)
    [packed] = pack([first, second], 64)
    assert packed.tokens == [0, 1, 2, 3, 4]
    return packed.tensors("cpu")


def naive(node: int, target: int) -> tuple[float, float, list[float]]:
    """log p(target), the entropy and the gradient of log p(target) over the node's row, one number at a time."""
    row = LOGITS[node]
    total = sum(math.exp(x) for x in row)
    probs = [math.exp(x) / total for x in row]
    grad = [(1.0 if k == target else 0.0) - p for k, p in enumerate(probs)]
    return row[target] - math.log(total), -sum(p * math.log(p) for p in probs), grad


def test_each_entry_gets_the_log_prob_and_entropy_of_its_token_at_its_node():
    batch = siblings()
    table = Table()
    logprobs, entropy, values = PolicyModel(table).run(batch)
    entries = list(zip(batch.entry_nodes.tolist(), batch.targets.tolist(), strict=True))
    assert sorted(entries) == [(0, 1), (1, 2), (1, 4), (2, 3)]
    want = [naive(node, target) for node, target in entries]
    assert logprobs.tolist() == pytest.approx([w[0] for w in want], abs=1e-6)
    assert entropy.tolist() == pytest.approx([w[1] for w in want], abs=1e-6)
    assert values is None
    logprobs.sum().backward()  # the gradient of the summed log-probs, node by node (node 1 serves two entries)
    expected = [[0.0] * 5 for _ in LOGITS]
    for (node, _), (_, _, grad) in zip(entries, want, strict=True):
        expected[node] = [a + b for a, b in zip(expected[node], grad, strict=True)]
    assert table.logits.grad is not None
    assert torch.allclose(table.logits.grad, torch.tensor(expected), atol=1e-6)


def test_a_model_that_is_not_a_hugging_face_causal_lm_cannot_run_chains_segment_by_segment():
    batch = siblings()
    with pytest.raises(ValueError, match="segment-wise tree attention needs a Hugging Face causal LM"):
        PolicyModel(Table())(batch.input_ids, batch.position_ids, None, batch.entry_nodes, [(0, 4, -1), (4, 5, 0)])


def test_head_on_trained_positions_only_equals_full_logits(model_dir):
    """The learner runs the output head only where tokens are trained; values must be identical."""
    from transformers import AutoModelForCausalLM

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


@pytest.fixture
def critic(model_dir) -> PolicyModel:
    from transformers import AutoModelForCausalLM

    return PolicyModel(AutoModelForCausalLM.from_pretrained(model_dir), value_head=True)


def chain(tokens: list[int], start: int) -> MicroBatch:
    [packed] = pack([Sequence.single(tokens, start, [-1.0] * (len(tokens) - start), 1.0)], 4096)
    return packed.tensors("cpu")


def test_the_value_head_starts_at_zero_and_reads_the_last_hidden_state_at_trained_nodes(critic):
    tokens = [5, 17, 99, 3, 250, 8, 41]
    batch = chain(tokens, 3)
    _, _, values = critic.run(batch)
    assert values is not None and values.tolist() == [0.0] * 4  # the critic starts at V = 0 everywhere
    assert critic.value_head is not None
    hidden_size = critic.value_head.in_features
    with torch.no_grad():
        critic.value_head.weight.copy_(torch.linspace(-1.0, 1.0, hidden_size)[None])
        critic.value_head.bias.fill_(0.5)
        _, _, values = critic.run(batch)
        hidden = critic.lm(input_ids=torch.tensor([tokens]), output_hidden_states=True).hidden_states[-1][0]
    assert values is not None
    weights = critic.value_head.weight[0].tolist()
    for value, node in zip(values.tolist(), batch.entry_nodes.tolist(), strict=True):
        naive_value = 0.5 + sum(w * h for w, h in zip(weights, hidden[node].tolist(), strict=True))
        assert value == pytest.approx(naive_value, abs=1e-4)


def test_the_critic_trains_apart_from_the_policy(critic):
    batch = chain([5, 17, 99, 3, 250, 8, 41], 2)
    assert critic.value_head is not None
    torch.nn.init.normal_(critic.value_head.weight)
    logprobs, _, values = critic.run(batch)
    assert values is not None
    (values**2).sum().backward(retain_graph=True)  # the critic's loss
    assert all(p.grad is None for p in critic.lm.parameters())  # never moves the policy's weights
    assert critic.value_head.weight.grad is not None and float(critic.value_head.weight.grad.abs().sum()) > 0
    critic.value_head.zero_grad(set_to_none=True)
    logprobs.sum().backward()  # the policy's loss
    assert critic.value_head.weight.grad is None
    assert sum(float(p.grad.abs().sum()) for p in critic.lm.parameters() if p.grad is not None) > 0
