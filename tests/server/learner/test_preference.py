"""DPO's learner side: pairs read in every accepted shape and refused with the reason otherwise; a DPO step's
per-token stand-in has exactly the gradient of the pair loss computed directly on the unpacked sequences;
repeated steps order the pairs right; scoring changes nothing."""

from __future__ import annotations

import copy

import pytest
import torch

from agentjet_server.engine.tokens import ChatTokenizer
from agentjet_server.errors import InvalidRequestError
from agentjet_server.learner.preference import pairs_batch, preference_pair
from agentjet_server.learner.trainer import Learner, LearnerConfig
from tests.server.learner.test_supervised import WORDS, runs


def digit_pairs(offset: int = 3) -> list[dict]:  # type: ignore[type-arg]
    return [
        {
            "prompt": [{"role": "user", "content": f"Write {w} as a digit."}],
            "chosen": str(d),
            "rejected": str((d + offset) % 10),
        }
        for d, w in enumerate(WORDS)
    ]


def test_pairs_in_each_shape_train_their_answers_alone_and_bad_pairs_are_refused(model_dir):
    chat = ChatTokenizer(model_dir)
    ask = [{"role": "system", "content": "Digits only."}, {"role": "user", "content": "Write two as a digit."}]
    earlier = [{"role": "user", "content": "Write one."}, {"role": "assistant", "content": "1"}]
    shapes = [
        {"prompt": ask, "chosen": "2", "rejected": "3"},
        {
            "prompt": ask,
            "chosen": {"role": "assistant", "content": "2"},
            "rejected": [{"role": "assistant", "content": "3"}],
        },
        # whole conversations: the messages they share are the prompt (an earlier assistant turn is context)
        {
            "chosen": [*earlier, *ask, {"role": "assistant", "content": "2"}],
            "rejected": [*earlier, *ask, {"role": "assistant", "content": "3"}],
        },
    ]
    for pair in shapes:
        chosen, rejected = preference_pair(chat, pair)
        trained = [chat.decode_all([s.tokens[p] for p in run]) for s in (chosen, rejected) for run in runs(s.positions)]
        assert trained == ["2<|im_end|>", "3<|im_end|>"], pair
        assert chosen.tokens[: chosen.positions[0]] == rejected.tokens[: rejected.positions[0]]  # one prompt
    prompt_only = {"role": "user", "content": "Write two as a digit."}
    assert preference_pair(chat, {"prompt": "Write two as a digit.", "chosen": "2", "rejected": "3"})[0].tokens == (
        preference_pair(chat, {"prompt": [prompt_only], "chosen": "2", "rejected": "3"})[0].tokens
    )
    for pairs, message in [
        ([], "non-empty list"),
        ([{"prompt": ask, "chosen": "2"}], r'pairs\[0\] needs "chosen" and "rejected"'),
        ([{"prompt": ask, "chosen": "2", "rejected": "2"}], "the same"),
        ([{"prompt": ask, "chosen": 2, "rejected": "3"}], '"chosen" must be a string'),
        ([{"prompt": ask, "chosen": "2", "rejected": "3", "score": 1}], 'unknown field "score"'),
        ([{"prompt": ask, "chosen": [], "rejected": "3"}], r"pairs\[0\] \(chosen\) has no assistant message"),
        ([{"prompt": ask, "chosen": "2", "rejected": "3"}], "ref_chosen_logps"),  # training needs the reference
        ([{"prompt": ask, "chosen": "2", "rejected": "3", "ref_chosen_logps": -1.0}], "ref_rejected_logps"),
        (
            [{"prompt": ask, "chosen": "2", "rejected": "3", "ref_chosen_logps": 1.0, "ref_rejected_logps": -1.0}],
            "at most 0",
        ),
    ]:
        with pytest.raises(InvalidRequestError, match=message):
            pairs_batch(chat, pairs)
    scored, referenced = pairs_batch(chat, [{"prompt": ask, "chosen": "2", "rejected": "3"}], train=False)
    assert not referenced and scored.mode == "dpo" and len(scored.sequences) == 2


def reference_for(chat: ChatTokenizer, learner: Learner, pairs: list[dict], shift: float = 0.0) -> list[dict]:  # type: ignore[type-arg]
    """The pairs with reference log-probs: their scores now, the chosen ones' moved by ``-shift``, 0 or
    ``shift`` (and a little more, so that no margin is 0)."""
    scored, _ = pairs_batch(chat, pairs, train=False)
    logps = learner.score(scored).tolist()
    return [
        {
            **pair,
            "ref_chosen_logps": min(logps[2 * i] + shift * (i % 3 - 1 + 0.1), 0.0),
            "ref_rejected_logps": logps[2 * i + 1],
        }
        for i, pair in enumerate(pairs)
    ]


def test_a_dpo_step_has_the_gradient_of_the_pair_loss_on_unpacked_sequences(model_dir):
    from transformers import AutoModelForCausalLM

    chat = ChatTokenizer(model_dir)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    direct = copy.deepcopy(model)
    learner = Learner(model, LearnerConfig(lr=1e-3, max_grad_norm=1e9), pad_id=chat.pad_id)
    pairs = reference_for(chat, learner, digit_pairs(), shift=0.7)  # margins of both signs: varied weights
    batch, referenced = pairs_batch(chat, pairs, beta=0.5)
    assert referenced
    stats = learner.step(batch)

    sums = []
    for sequence in batch.sequences:
        logits = direct(input_ids=torch.tensor([sequence.tokens])).logits[0].float()
        logp = torch.log_softmax(logits, dim=-1)
        sums.append(sum(logp[p - 1, sequence.tokens[p]] for p in sequence.positions))
    logps = torch.stack(sums)
    ref = torch.tensor([[p["ref_chosen_logps"], p["ref_rejected_logps"]] for p in pairs]).reshape(-1)
    z = 0.5 * ((logps[0::2] - ref[0::2]) - (logps[1::2] - ref[1::2]))
    loss = torch.nn.functional.softplus(-z).mean()
    loss.backward()
    assert stats.loss == pytest.approx(float(loss.detach()), rel=1e-4)
    assert stats.extra["accuracy"] == pytest.approx(float((z.detach() > 0).float().mean()))
    assert stats.extra["reward_margin"] == pytest.approx(float(z.detach().mean()), abs=1e-4)
    learned = dict(model.named_parameters())
    compared = 0
    for name, parameter in direct.named_parameters():
        if parameter.grad is None:
            continue
        got = learned[name].grad
        assert got is not None, name
        assert torch.allclose(got, parameter.grad, rtol=1e-3, atol=1e-6), (
            name,
            float((got - parameter.grad).abs().max()),
        )
        compared += 1
    assert compared == len(list(direct.parameters()))


def test_dpo_steps_order_the_pairs_and_scoring_changes_nothing(model_dir):
    from transformers import AutoModelForCausalLM

    chat = ChatTokenizer(model_dir)
    torch.manual_seed(0)
    learner = Learner(AutoModelForCausalLM.from_pretrained(model_dir), LearnerConfig(lr=3e-3), pad_id=chat.pad_id)
    pairs = reference_for(chat, learner, digit_pairs())
    weights = [p.detach().clone() for p in learner.model.parameters()]
    reference_for(chat, learner, digit_pairs())  # scoring again: nothing moves
    assert all(torch.equal(a, b) for a, b in zip(weights, learner.model.parameters(), strict=True))
    batch, _ = pairs_batch(chat, pairs, beta=0.1)
    first = learner.step(batch)
    assert first.loss == pytest.approx(0.6931, abs=1e-3) and first.extra["reward_margin"] == pytest.approx(0, abs=1e-4)
    for _ in range(15):
        last = learner.step(pairs_batch(chat, pairs, beta=0.1)[0])
    assert last.extra["accuracy"] == 1.0 and last.extra["reward_margin"] > 0.5 and last.loss < 0.4, last.extra
