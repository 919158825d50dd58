"""Supervised fine-tuning's learner side: a chat rendered with the chat template, its assistant tokens (through
each end-of-turn token) trained and nothing else; chats that cannot be trained so are refused with the
reason; supervised updates lower the loss, and ``evaluate`` measures what the update's own figure says."""

from __future__ import annotations

import pytest
import torch

from agentjet_server.engine.tokens import ChatTokenizer
from agentjet_server.errors import InvalidRequestError
from agentjet_server.learner.supervised import conversation, evaluate, examples_batch
from agentjet_server.learner.trainer import Learner, LearnerConfig

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}]
CALL = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"word": "seven"}'}}
CHAT = [
    {"role": "system", "content": "Answer with one digit."},
    {"role": "user", "content": "Write seven as a digit."},
    {"role": "assistant", "content": "7"},
    {"role": "user", "content": "Look up eight."},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "c1", "content": "8"},
    {"role": "assistant", "content": "It is 8."},
]


def runs(positions: list[int]) -> list[list[int]]:
    """Consecutive positions, grouped."""
    out: list[list[int]] = []
    for p in positions:
        if out and out[-1][-1] == p - 1:
            out[-1].append(p)
        else:
            out.append([p])
    return out


def test_the_assistant_tokens_of_a_chat_are_trained_and_nothing_else(model_dir):
    chat = ChatTokenizer(model_dir)
    sequence = conversation(chat, CHAT, TOOLS)
    assert sequence.tokens == chat.encode(chat.render_text(CHAT, TOOLS, add_generation_prompt=False))
    trained = [chat.decode_all([sequence.tokens[p] for p in run]) for run in runs(sequence.positions)]
    assert trained == [
        "7<|im_end|>",
        '<tool_call>{"name": "lookup", "arguments": {"word": "seven"}}</tool_call><|im_end|>',
        "It is 8.<|im_end|>",
    ]
    context = chat.decode_all([t for i, t in enumerate(sequence.tokens) if i not in set(sequence.positions)])
    for text in ("Answer with one digit.", "Write seven as a digit.", "Look up eight.", "<tools>", "8<|im_end|>"):
        assert text in context
    assert len(sequence.old_logprobs) == len(sequence.advantages) == len(sequence.positions)


# a template that shows only the last assistant message's content: earlier turns change once one follows
REWRITING = (
    "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}<|im_start|>assistant\n<|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_chats_that_cannot_be_trained_as_sampled_are_refused_with_the_reason(model_dir):
    chat = ChatTokenizer(model_dir)
    with pytest.raises(InvalidRequestError, match="no assistant message"):
        conversation(chat, [{"role": "user", "content": "Hi"}])
    with pytest.raises(InvalidRequestError, match="rewrites earlier turns"):
        conversation(ChatTokenizer(model_dir, REWRITING), [*CHAT[1:4], {"role": "assistant", "content": "8"}])
    for examples, message in [
        ([], "non-empty list"),
        ([{"text": "hi"}], r"examples\[0\] needs \"messages\""),
        ([{"messages": CHAT, "tools": "lookup"}], '"tools" must be a list'),
        ([{"messages": CHAT}, {"messages": CHAT[:2]}], r"examples\[1\] has no assistant message"),
    ]:
        with pytest.raises(InvalidRequestError, match=message):
            examples_batch(chat, examples)


def digit_chats() -> list[dict]:  # type: ignore[type-arg]
    return [
        {"messages": [{"role": "user", "content": f"Write {w} as a digit."}, {"role": "assistant", "content": str(d)}]}
        for d, w in enumerate(WORDS)
    ]


def test_supervised_updates_lower_the_loss_and_evaluate_agrees_with_the_update(model_dir):
    from transformers import AutoModelForCausalLM

    chat = ChatTokenizer(model_dir)
    torch.manual_seed(0)
    learner = Learner(AutoModelForCausalLM.from_pretrained(model_dir), LearnerConfig(lr=3e-3), pad_id=chat.pad_id)
    batch = examples_batch(chat, digit_chats())
    assert batch.mode == "sft" and batch.trained_tokens == 20  # each digit and its end-of-turn token
    total, count = evaluate(learner, batch)
    first = learner.step(batch)
    assert count == 20 and first.extra["nll"] == pytest.approx(total / count, rel=1e-4)  # the same weights
    for _ in range(40):
        learner.step(batch)
    after, _ = evaluate(learner, batch)
    assert after / count < 0.5 * total / count, (total / count, after / count)
