"""Preference training (DPO): pairs of answers to one prompt, the chosen one made likelier than the rejected one.

A pair is ``{"prompt": [...], "chosen": ..., "rejected": ..., "tools": [...]}`` in the OpenAI messages
format: the prompt a list of messages (or a string: one user message), each answer a string (the assistant's
content), one assistant message, or a list of messages (tool calls and their results included). Without a
``prompt``, ``chosen`` and ``rejected`` are whole conversations and the messages they begin with in common
are the prompt. Each answer becomes a ``Sequence`` (``supervised.conversation``): the prompt's tokens are
context, the answer's assistant tokens are scored and trained.

DPO compares the policy with a reference: the model as it was before preference training started. The
reference log-probs of a pair (``ref_chosen_logps``, ``ref_rejected_logps``: each answer's summed
log-prob) are part of the pair: ``agentjet-client dpo`` scores every pair once, before the first update,
and sends the figures with each pair. They travel in the batch's ``old_logprobs`` (a sequence's
reference log-prob spread evenly over its trained tokens), so ``prepare.weigh_pairs`` reads them back by
summing. A batch is ``[chosen0, rejected0, chosen1, ...]`` of ``mode`` "dpo".
"""

from __future__ import annotations

import math
from typing import Any

from agentjet_server.engine.tokens import ChatTokenizer
from agentjet_server.errors import InvalidRequestError
from agentjet_server.learner.batch import Batch, Sequence
from agentjet_server.learner.supervised import conversation

MAX_PAIRS = 256  # pairs per request: a request is one update (or one scoring), answered when done
REFERENCE = ("ref_chosen_logps", "ref_rejected_logps")


def _messages(value: Any, where: str, name: str) -> list[dict[str, Any]]:
    """A prompt or an answer as a list of messages."""
    if isinstance(value, str):
        return [{"role": "user" if name == "prompt" else "assistant", "content": value}]
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(m, dict) and "role" in m for m in value):
        raise InvalidRequestError(
            f'{where}: "{name}" must be a string, a message {{"role": ..., "content": ...}} or a list of messages'
        )
    return value


def preference_pair(chat: ChatTokenizer, pair: Any, where: str = "pair") -> tuple[Sequence, Sequence]:
    """One pair as its (chosen, rejected) sequences; a 400 naming what is wrong with it."""
    if not isinstance(pair, dict) or "chosen" not in pair or "rejected" not in pair:
        raise InvalidRequestError(f'{where} needs "chosen" and "rejected" (and a "prompt", or whole conversations)')
    unknown = sorted(set(pair) - {"prompt", "chosen", "rejected", "tools", *REFERENCE})
    if unknown:
        raise InvalidRequestError(f'{where}: unknown field "{unknown[0]}"')
    tools = pair.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise InvalidRequestError(f'{where}: "tools" must be a list of tool definitions')
    chosen = _messages(pair["chosen"], where, "chosen")
    rejected = _messages(pair["rejected"], where, "rejected")
    if "prompt" in pair:
        prompt = _messages(pair["prompt"], where, "prompt")
    else:  # whole conversations: the prompt is what they share
        shared = 0
        while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
            shared += 1
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
    if chosen == rejected:
        raise InvalidRequestError(f"{where}: the chosen and the rejected answer are the same: nothing to prefer")
    first = len(prompt)
    return (
        conversation(chat, prompt + chosen, tools, f"{where} (chosen)", first),
        conversation(chat, prompt + rejected, tools, f"{where} (rejected)", first),
    )


def _reference(pair: dict[str, Any], where: str, required: bool) -> tuple[float, float] | None:
    present = [name for name in REFERENCE if name in pair]
    if not present and not required:
        return None
    values = [pair.get(name) for name in REFERENCE]
    if len(present) < 2 or not all(
        isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v <= 0 for v in values
    ):
        raise InvalidRequestError(
            f"{where}: training needs each answer's reference log-prob, {REFERENCE[0]} and {REFERENCE[1]} "
            '(sums of log-probs: numbers at most 0); score the pairs first with "evaluate": true, as '
            "agentjet-client dpo does"
        )
    return float(values[0]), float(values[1])  # type: ignore[arg-type]


def pairs_batch(chat: ChatTokenizer, pairs: Any, beta: float = 0.1, train: bool = True) -> tuple[Batch, bool]:
    """The request's ``pairs`` as a DPO batch (``train``: each pair must carry its reference log-probs),
    and whether every pair carries them."""
    if not isinstance(pairs, list) or not pairs:
        raise InvalidRequestError(
            '"pairs" must be a non-empty list of {"prompt": [...], "chosen": ..., "rejected": ...} objects'
        )
    if len(pairs) > MAX_PAIRS:
        raise InvalidRequestError(f"{len(pairs)} pairs in one request; send at most {MAX_PAIRS} per request")
    sequences: list[Sequence] = []
    references = []
    for i, pair in enumerate(pairs):
        where = f"pairs[{i}]"
        chosen, rejected = preference_pair(chat, pair, where)
        reference = _reference(pair, where, train)
        references.append(reference)
        for sequence, ref in zip((chosen, rejected), reference or (0.0, 0.0), strict=True):
            share = ref / sequence.trained_tokens
            sequence.old_logprobs = [share] * sequence.trained_tokens
            sequence.group = len(sequences)
            sequences.append(sequence)
    return Batch(sequences, [], len(pairs), 0, len(pairs), mode="dpo", beta=beta), None not in references
