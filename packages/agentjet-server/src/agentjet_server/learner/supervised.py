"""Supervised fine-tuning: chats in the OpenAI messages format trained with the chat template's assistant mask.

``conversation`` renders one chat with the model's own chat template and marks the tokens of every
assistant message (content and tool calls, through its end-of-turn token) as trained; everything else
(system, user and tool messages, the template's headers) is context. It renders the chat incrementally:
for each assistant message, the conversation before it with the generation prompt, and the conversation
through it, and requires each rendering to begin with the tokens of the one before, so that the trained
tokens are exactly the tokens the model would have had to sample at those positions. A template that
rewrites earlier turns (one that drops earlier reasoning, say) fails that check and the chat is refused,
naming the message.

The sequences go through the learner as a ``Batch`` of ``mode`` "sft" (``supervised_batch``): the same
packing, micro-batching and optimizer as the policy updates, with the negative log-likelihood as the loss
(``objective.objective``). ``evaluate`` gives the loss of a batch without updating anything (the held-out part).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

from agentjet_server.engine.tokens import ChatTokenizer
from agentjet_server.errors import InvalidRequestError
from agentjet_server.learner.batch import Batch, Sequence
from agentjet_server.learner.trainer import Learner


def conversation(
    chat: ChatTokenizer,
    messages: Seq[dict[str, Any]],
    tools: Seq[dict[str, Any]] | None = None,
    where: str = "chat",
    first: int = 0,
) -> Sequence:
    """One chat as a trainable sequence: its tokens, the assistant messages' tokens trained (those from
    message ``first`` on: the ones before it are context, as a preference pair's prompt is)."""
    if not any(m.get("role") == "assistant" for m in messages[first:]):
        raise InvalidRequestError(f"{where} has no assistant message: there is nothing to learn from it")
    full = chat.encode(chat.render_text(messages, tools, add_generation_prompt=False))
    trained: list[int] = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant" or i < first:
            continue
        before = chat.encode(chat.render_text(messages[:i], tools, add_generation_prompt=True))
        through = chat.encode(chat.render_text(messages[: i + 1], tools, add_generation_prompt=False))
        if through[: len(before)] != before or full[: len(through)] != through:
            raise InvalidRequestError(
                f"{where}: the chat template renders message {i} (assistant) so that the tokens before it change "
                "(it rewrites earlier turns), so its tokens cannot be trained as the model samples them; send the "
                "conversation up to that message as a chat of its own"
            )
        end = len(through)
        for position in range(len(before), len(through)):  # through the end-of-turn token, not what follows
            if through[position] in chat.stop_ids:
                end = position + 1
                break
        trained.extend(range(len(before), end))
    if not trained:
        raise InvalidRequestError(f"{where}: its assistant messages are empty: there is nothing to learn from it")
    n = len(trained)
    return Sequence(full, trained, [0.0] * n, [0.0] * n)


def supervised_batch(sequences: list[Sequence]) -> Batch:
    """Sequences trained with the supervised loss, each its own group (no group structure applies)."""
    for group, sequence in enumerate(sequences):
        sequence.group = group
    return Batch(sequences, [], len(sequences), 0, len(sequences), mode="sft")


def evaluate(learner: Learner, batch: Batch, adapter: str | None = None) -> tuple[float, int]:
    """(learner thread) The summed negative log-likelihood of the batch's trained tokens, and their count,
    under the learner's weights (of ``adapter``, with an adapter per agent); nothing is updated."""
    return -float(learner.score(batch, adapter).sum()), batch.trained_tokens


MAX_EXAMPLES = 512  # chats per request: a request is one update (or one evaluation), answered when done


def examples_batch(chat: ChatTokenizer, examples: Any) -> Batch:
    """The request body's ``examples`` (``[{"messages": [...], "tools": [...]}]``) as a supervised batch;
    a 400 naming the example that is wrong."""
    if not isinstance(examples, list) or not examples:
        raise InvalidRequestError('"examples" must be a non-empty list of {"messages": [...]} objects')
    if len(examples) > MAX_EXAMPLES:
        raise InvalidRequestError(f"{len(examples)} examples in one request; send at most {MAX_EXAMPLES} per request")
    sequences = []
    for i, example in enumerate(examples):
        where = f"examples[{i}]"
        messages = example.get("messages") if isinstance(example, dict) else None
        tools = example.get("tools") if isinstance(example, dict) else None
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise InvalidRequestError(f'{where} needs "messages": a list of {{"role": ..., "content": ...}} objects')
        if tools is not None and not isinstance(tools, list):
            raise InvalidRequestError(f'{where}: "tools" must be a list of tool definitions')
        sequences.append(conversation(chat, messages, tools, where))
    return supervised_batch(sequences)
