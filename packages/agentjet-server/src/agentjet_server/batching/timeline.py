"""Timeline merging: an episode's LLM calls become the fewest token sequences with exact loss masks.

Every call (a ``Turn``) is the prompt tokens the policy saw plus the completion tokens it sampled.
A multi-turn agent re-sends its whole history each turn, so training one sequence per call
processes the history again and again (O(T^2) tokens for T turns). Within one agent's calls, in
order, a call whose prompt *begins with exactly the tokens* of an earlier timeline (everything
that timeline saw and sampled) continues it: the prompt's new tokens (tool results, user turns,
template) are appended untrained, the new completion trained. Otherwise (history edited,
compacted or retried, re-tokenised text that drifted, another conversation) the call starts a new
timeline. Tokens are compared, never text, so every trained token is the token that was sampled,
at the position and after exactly the context it was sampled with.

Agents keep separate timelines, and so do adapters (a model name may pick another agent's
adapter). Sharing between timelines (GRPO siblings' prompt, agents' common system prompt) is the
packer's job (``learner.packing``), not merging's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from agentjet_client.protocol import Turn


@dataclass
class Timeline:
    """One agent's merged calls: ``tokens``, and which of them were sampled (trained)."""

    agent: str
    adapter: str | None = None  # the adapter that sampled its calls (an adapter per agent), trained with them
    tokens: list[int] = field(default_factory=list)
    trained: list[int] = field(default_factory=list)  # positions in ``tokens`` of sampled tokens
    old_logprobs: list[float] = field(default_factory=list)  # behaviour log-prob of each trained token
    versions: list[int] = field(default_factory=list)  # policy version that sampled each trained token
    turn_of: list[int] = field(default_factory=list)  # the turn each trained token came from
    # whether each trained token was sampled from a processed distribution (its old log-prob is that one's)
    processed: list[bool] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)  # indices of the turns merged here, in order

    def extends(self, prompt: Sequence[int]) -> bool:
        n = len(self.tokens)
        return n <= len(prompt) and list(prompt[:n]) == self.tokens


def build_timelines(turns: Sequence[Turn]) -> list[Timeline]:
    """Merge an episode's turns (in call order) into timelines; see the module docstring."""
    timelines: list[Timeline] = []
    for index, turn in enumerate(turns):
        prompt = turn.prompt_token_ids
        candidates = [t for t in timelines if (t.agent, t.adapter) == (turn.agent, turn.adapter) and t.extends(prompt)]
        if candidates:
            timeline = max(candidates, key=lambda t: len(t.tokens))
        else:
            timeline = Timeline(turn.agent, turn.adapter)
            timelines.append(timeline)
        timeline.tokens.extend(prompt[len(timeline.tokens) :])
        start = len(timeline.tokens)
        timeline.tokens.extend(turn.completion_token_ids)
        timeline.trained.extend(range(start, len(timeline.tokens)))
        timeline.old_logprobs.extend(turn.completion_logprobs)
        timeline.versions.extend(turn.completion_versions or [turn.policy_version] * len(turn.completion_token_ids))
        timeline.turn_of.extend([index] * len(turn.completion_token_ids))
        timeline.processed.extend([turn.sampled_from == "processed"] * len(turn.completion_token_ids))
        timeline.turns.append(index)
    return timelines


def call_tokens(turns: Sequence[Turn]) -> int:
    """Tokens a one-sample-per-call trainer processes for these turns."""
    return sum(len(t.prompt_token_ids) + len(t.completion_token_ids) for t in turns)
