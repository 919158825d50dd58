"""Token-in/token-out across turns: a request that continues an earlier call starts from the exact
tokens that call saw and sampled, not from a re-rendering of its text.

An agent's turn k+1 carries turn k's answer back as an assistant message. Rendering that message
through the chat template and tokenizing it again can give other token ids than the ones sampled
(a BPE merges differently than the model happened to sample; a tool call's JSON is re-serialised
with other spacing). Training on such a prompt would condition turn k+1 on tokens the model never
produced, and its timeline could not be merged with turn k's. So the client tells the server which
earlier call the request continues (``agentjet.prefix_token_ids``: that call's prompt + completion,
and ``prefix_prompt_tokens``: where its prompt ends), and the server:

1. ``extended``: if the prefix decodes to exactly the start of the rendered prompt text, the prompt
   is the prefix tokens followed by the tokens of the rest of the text;
2. ``spliced``: else, if the prefix's prompt part renders the messages before one assistant message
   (exactly, or with earlier assistant messages as the text sampled for them: a call that continued
   spliced calls) and the prefix's completion parses (content, tool calls) to that assistant message,
   the prompt is the prefix tokens followed by the tokens of what comes after that message (after
   the template's end-of-turn, which closes a completion that ``max_tokens`` cut off);
3. ``mismatch``: else the history really differs (edited, retried, compacted): the messages are
   rendered afresh, as without a prefix.

``reasoning_dropped``: the prefix's completion held reasoning (as the server's reasoning parser
reads it) and the chat template leaves reasoning out of that assistant message even when it is
given (Qwen3 keeps it only for the turns after the last user message). Splicing would show the
model its old reasoning where serving it normally would not, so the messages are rendered afresh
as the template wants: a new timeline, counted on its own, not as a mismatch.

``drift`` reports whether rendering afresh would have produced other tokens than the prefix, i.e.
what this module prevented; it is counted in ``/v1/status``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from agentjet_server.engine.tokens import ChatTokenizer
from agentjet_server.serving.chat_format import parse_tool_calls
from agentjet_server.serving.parsing import Parsed

Status = Literal["extended", "spliced", "mismatch", "reasoning_dropped"]
Reader = Callable[[list[int]], Parsed]  # an earlier completion's token ids, read as an answer
logger = logging.getLogger(__name__)
# assistant messages that could be the one a prefix's completion answered (the same answer given
# more than once), tried newest first; each try renders the messages before it once per earlier answer
_TRIES = 4


@dataclass(frozen=True)
class Continuation:
    prompt_ids: list[int]
    status: Status
    drift: bool  # a fresh rendering would not have started with the prefix tokens


def continue_from(
    chat: ChatTokenizer,
    prefix_ids: Sequence[int],
    prompt_tokens: int,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    assistant_prefix: str = "",
    read: Reader | None = None,
) -> Continuation:
    prefix = list(prefix_ids)
    read = read or _hermes_reader(chat)
    text = chat.render_text(messages, tools) + assistant_prefix
    fresh = chat.encode(text)
    differs = fresh[: len(prefix)] != prefix
    prefix_text = chat.decode_all(prefix)
    if text.startswith(prefix_text):
        return Continuation(prefix + chat.encode(text[len(prefix_text) :]), "extended", differs)
    spliced = _splice(chat, prefix, prompt_tokens, messages, tools, text, read)
    if spliced == "reasoning_dropped":
        return Continuation(fresh, "reasoning_dropped", False)
    if isinstance(spliced, list):
        return Continuation(spliced, "spliced", differs)
    at = next((i for i, (a, b) in enumerate(zip(prefix_text, text, strict=False)) if a != b), len(prefix_text))
    logger.info(
        "a request continues an earlier call but its history differs from what was sampled (rendered "
        "afresh; a new timeline starts), from character %d: sampled %r, sent %r",
        at,
        prefix_text[max(0, at - 20) : at + 60],
        text[max(0, at - 20) : at + 60],
    )
    return Continuation(fresh, "mismatch", False)


def _splice(
    chat: ChatTokenizer,
    prefix: list[int],
    prompt_tokens: int,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    text: str,
    read: Reader,
) -> list[int] | str | None:
    if not 0 < prompt_tokens < len(prefix):
        return None
    prompt, completion = prefix[:prompt_tokens], prefix[prompt_tokens:]
    prompt_text = chat.decode_all(prompt)
    # a completion cut off by max_tokens has no end-of-turn: the template's closes it (as context); one
    # that stopped stands for the template's end-of-turn with its own stop token (which may be another
    # of the model's, <|endoftext|> where the template writes <|im_end|>)
    stopped = prefix[-1] in chat.stop_ids
    ends = [chat.decode_all([t]) for t in chat.stop_ids]
    answer = read(completion)
    candidates = [j for j, m in enumerate(messages) if m.get("role") == "assistant" and same_answer(answer, m)]
    for j in reversed(candidates[-_TRIES:]):  # the newest first: an agent sends its last answer back
        through = chat.render_text(messages[: j + 1], tools, add_generation_prompt=False)
        cut, end = max((through.rfind(e), e) for e in ends) if ends else (-1, "")
        if cut < 0 or not text.startswith(through) or not _renders(chat, prompt_text, messages, j, tools, read):
            continue
        if (
            answer.reasoning
            and answer.reasoning.strip()
            and _drops_reasoning(chat, messages, j, tools, answer.reasoning)
        ):
            return "reasoning_dropped"
        return prefix + chat.encode(text[cut + len(end) :] if stopped else text[cut:])
    return None


def _drops_reasoning(
    chat: ChatTokenizer,
    messages: Sequence[Mapping[str, Any]],
    j: int,
    tools: Sequence[Mapping[str, Any]] | None,
    reasoning: str,
) -> bool:
    """Whether the template renders the conversation the same with and without message ``j``'s
    reasoning: it leaves that reasoning out (where it stands in this conversation)."""
    plain = {k: v for k, v in messages[j].items() if k not in ("reasoning", "reasoning_content")}
    given = {**plain, "reasoning": reasoning, "reasoning_content": reasoning}
    rest = list(messages[j + 1 :])
    with_it = chat.render_text([*messages[:j], given, *rest], tools)
    return with_it == chat.render_text([*messages[:j], plain, *rest], tools)


def _renders(
    chat: ChatTokenizer,
    prompt_text: str,
    messages: Sequence[Mapping[str, Any]],
    j: int,
    tools: Sequence[Mapping[str, Any]] | None,
    read: Reader,
) -> bool:
    """Whether ``prompt_text`` is ``messages[:j]`` as the template renders them (with the generation
    prompt), except that an assistant message may appear as the text the model sampled for it, when
    that text parses to the message: how the prompt of a call that continued spliced calls reads."""
    rendered = chat.render_text(messages[:j], tools)
    if prompt_text == rendered:
        return True
    ends = [chat.decode_all([t]) for t in chat.stop_ids]
    at = 0  # how far into ``rendered`` (the template's text) and into ``prompt_text`` they agree
    seen = 0
    for i in range(j):
        if messages[i].get("role") != "assistant":
            continue
        head = chat.render_text(messages[:i], tools)  # up to where the model sampled message i
        through = chat.render_text(messages[: i + 1], tools, add_generation_prompt=False)
        cut, end = max((through.rfind(e), e) for e in ends) if ends else (-1, "")
        if not (rendered.startswith(through) and through.startswith(head)) or cut < len(head) or len(head) < at:
            return False  # a template that is not prefix-stable: no splicing across it
        between = rendered[at : len(head)]  # the other messages' text, the same in both
        if not prompt_text.startswith(between, seen):
            return False
        seen += len(between)
        # the sampled answer ends at the first stop token the model wrote, whichever of its stop tokens
        found = [
            (stop, sampled_end) for stop, sampled_end in ((prompt_text.find(e, seen), e) for e in ends) if stop >= 0
        ]
        if not found:
            return False
        stop, sampled_end = min(found)
        body = prompt_text[seen:stop]
        if body != through[len(head) : cut] and not same_answer(read(chat.encode(body)), messages[i]):
            return False
        seen, at = stop + len(sampled_end), cut + len(end)
    return prompt_text[seen:] == rendered[at:]


def _hermes_reader(chat: ChatTokenizer) -> Reader:
    def read(completion: list[int]) -> Parsed:
        out = parse_tool_calls(chat.decode(completion))
        return Parsed(None, out.content, out.tool_calls)

    return read


def same_answer(parsed: Parsed, message: Mapping[str, Any]) -> bool:
    """Whether the assistant ``message`` the agent sent back is what the server answered (``parsed``);
    its reasoning is not compared: agents may or may not send it back."""
    calls = message.get("tool_calls") or []
    if len(calls) != len(parsed.tool_calls):
        return False
    for sent, ours in zip(calls, parsed.tool_calls, strict=True):
        function = sent.get("function") or {}
        if function.get("name") != ours.function.name or _json(function.get("arguments")) != _json(
            ours.function.arguments
        ):
            return False
    content = message.get("content")
    if isinstance(content, list):  # content blocks: their text, in order
        content = "".join(b.get("text", "") for b in content if isinstance(b, Mapping))
    return (content or "").strip() == (parsed.content or "").strip()


def _json(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value
