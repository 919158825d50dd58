"""The engine interface: the one seam between the server and whatever runs inference.

An engine renders chat messages to token ids with the model's chat template, samples
completions token by token with per-token log-probabilities, and swaps in new weights at a
version. Every sampled token is tagged with the version of the weights that produced it;
weights change only between decode steps, never inside one.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    top_logprobs: int = 0


@dataclass
class TokenEvent:
    """One sampled token. ``logprob`` is the model's log-probability (temperature 1)."""

    token_id: int
    logprob: float
    version: int
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    finish_reason: FinishReason | None = None


class Engine(abc.ABC):
    """What the server needs from inference."""

    model_name: str
    max_context: int

    @property
    @abc.abstractmethod
    def version(self) -> int:
        """The policy version of the weights new tokens are sampled from."""

    @abc.abstractmethod
    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        assistant_prefix: str = "",
    ) -> list[int]:
        """Token ids of the prompt, ending with the assistant header and ``assistant_prefix``."""

    @abc.abstractmethod
    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids``, special tokens dropped."""

    @abc.abstractmethod
    def is_stop_token(self, token_id: int) -> bool:
        """Whether sampling this token ends the turn (it is kept as a trained token)."""

    @abc.abstractmethod
    def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> AsyncIterator[TokenEvent]:
        """Sample one completion; yields each token as soon as it exists."""

    @abc.abstractmethod
    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Load new weights; applied between decode steps. Returns once they are live."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop the engine and release its resources."""

    @property
    def can_sleep(self) -> bool:
        """Whether ``sleep`` frees what the engine holds on its device (vLLM's sleep mode)."""
        return False

    def sleep(self) -> None:
        """Stop sampling and free the engine's device memory until ``wake`` or the next weight update
        (which wakes it first). Requests keep arriving: they wait, and those in flight resume. Returns
        once the memory is free."""
        raise NotImplementedError(f"{type(self).__name__} has no sleep mode (--engine-sleep needs --engine vllm)")

    def wake(self) -> None:  # noqa: B027 (not abstract: an engine without sleep mode is always awake)
        """Serve again with the weights the engine had before ``sleep``; nothing if it is awake."""
