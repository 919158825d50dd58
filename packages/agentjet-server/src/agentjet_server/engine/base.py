"""The engine interface: the one seam between the server and whatever runs inference.

An engine renders chat messages to token ids with the model's chat template, samples
completions token by token with per-token log-probabilities, and swaps in new weights at a
version. Every sampled token is tagged with the version of the weights that produced it;
weights change only between decode steps, never inside one.

``Engine`` declares everything the rest of the server asks of an engine, optional capabilities
included (a LoRA adapter served apart, replicas, sleep mode), each with the answer of an engine
that lacks it: the server never probes an engine with ``getattr``.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from agentjet_server.engine.adapter import LoraSpec
from agentjet_server.engine.tokens import ChatTokenizer, Messages, ToolSpecs, check_model_dir
from agentjet_server.errors import EngineError

FinishReason = Literal["stop", "length"]


SAMPLING_EPS = 1e-5  # vLLM's: below it a temperature divides logits into overflow, and means greedy


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling settings, normalised as vLLM normalises them: a temperature below
    ``SAMPLING_EPS`` (a denormal such as 5e-324 included) samples greedily, and greedy sampling has no
    nucleus (``top_p`` 1)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    top_logprobs: int = 0
    # what changes the distribution (``SamplingExtras.processing``): the tokens are then sampled from the
    # processed distribution, and each event carries that distribution's log-probability too
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    min_tokens: int = 0
    ignore_eos: bool = False
    grammar: tuple[str, str] | None = None  # response_format: ("json_object", "") or ("json_schema", schema)
    adapter: str | None = None  # an adapter per agent (``Engine.adapters``): the one this request samples with
    # the log-probability of each prompt token after the first, given those before it (temperature 1): the
    # first event carries them (``TokenEvent.prompt_logprobs``); what scoring a text with ``echo`` needs
    prompt_logprobs: bool = False

    @property
    def processed(self) -> bool:
        """Whether these settings change the model's distribution (beyond temperature and top-p)."""
        return bool(
            self.logit_bias
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.top_k > 0
            or self.min_p > 0
            or self.min_tokens
            or self.ignore_eos
            or self.grammar
        )

    def __post_init__(self) -> None:
        if self.temperature < SAMPLING_EPS:
            object.__setattr__(self, "temperature", 0.0)
            object.__setattr__(self, "top_p", 1.0)


# the request settings that change the model's distribution (as ``SamplingExtras.processing`` names them)
PROCESSED_SETTINGS = frozenset(
    {
        "logit_bias",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "top_k",
        "min_p",
        "min_tokens",
        "ignore_eos",
        "response_format",
    }
)

# what the vLLM engine samples with of those: its structured outputs (the grammar mask is applied to the logits
# its log-probabilities come from); its penalties, biases and filters act after them, so their behaviour is unknown
VLLM_PROCESSED_SETTINGS = frozenset({"response_format"})


@dataclass(frozen=True)
class EngineOptions:
    """How an engine in this process serves its model directory: what both engines (``hf``, ``vllm``)
    are started with; each takes its own extras beside it."""

    model_name: str | None = None  # served in /v1/models; None: the model directory's name
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    max_batch: int = 64  # requests sampled together
    version: int = 0  # the policy version of the weights it starts from
    chat_template: str | None = None  # Jinja source in place of the tokenizer's own
    # an adapter per agent (``--adapters``, with the LoRA ``lora``): one adapter per name on the frozen
    # base, each starting at the version in ``adapter_versions`` (0 if not there)
    adapters: tuple[str, ...] = ()
    lora: LoraSpec | None = None
    adapter_versions: tuple[tuple[str, int], ...] = ()


@dataclass
class TokenEvent:
    """One sampled token. ``logprob`` is the model's log-probability (temperature 1); ``behaviour`` that
    of the processed distribution it was sampled from (temperature 1), for processed settings only."""

    token_id: int
    logprob: float
    version: int
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    behaviour: float | None = None
    # a request's first event, if it asked for them (``SamplingParams.prompt_logprobs``): one per prompt token
    # after the first
    prompt_logprobs: list[float] | None = None


class Engine(abc.ABC):
    """What the server needs from inference. A subclass calls ``Engine.__init__`` with its model
    directory, sets ``max_context`` and implements ``generate``, ``update_weights`` and ``close``; the
    token side (render, decode, stops) comes from its ``chat``, and its engine thread advances
    ``_version`` as new weights land."""

    model_name: str  # served in /v1/models
    model_path: Path  # the model directory it was started from
    max_context: int  # prompt + completion tokens a request may take
    chat: ChatTokenizer  # the tokenizer and chat template
    _version: int

    def __init__(
        self,
        model_path: str | Path,
        *,
        model_name: str | None = None,
        chat_template: str | None = None,
        version: int = 0,
    ) -> None:
        """Check that ``model_path`` is a model directory and load its tokenizer (``chat_template`` in
        place of its own, if given). ``model_name`` defaults to the directory's name; ``version`` is the
        policy version of the weights the engine starts from."""
        path = Path(model_path)
        check_model_dir(path)
        self.model_path = path
        self.model_name = model_name or path.name
        self.chat = ChatTokenizer(path, chat_template)
        self._version = version
        # an adapter per agent: each adapter's version (an engine that serves them fills it)
        self._named: dict[str, int] = {}

    @property
    def version(self) -> int:
        """The policy version of the weights new tokens are sampled from."""
        return self._version

    @property
    def tokenizer(self) -> Any:
        """The Hugging Face tokenizer behind ``chat``."""
        return self.chat.tokenizer

    def render(self, messages: Messages, tools: ToolSpecs | None = None, assistant_prefix: str = "") -> list[int]:
        """Token ids of the prompt, ending with the assistant header and ``assistant_prefix``."""
        return self.chat.render(messages, tools, assistant_prefix)

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids``, special tokens dropped."""
        return self.chat.decode(token_ids)

    def is_stop_token(self, token_id: int) -> bool:
        """Whether sampling this token ends the turn (it is kept as a trained token)."""
        return token_id in self.chat.stop_ids

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
    def processed_settings(self) -> frozenset[str]:
        """The settings that change the distribution (``SamplingParams.processed``; of ``PROCESSED_SETTINGS``)
        the engine samples with, reporting each token's behaviour log-probability under the processed
        distribution: the transformers engine all of them, vLLM ``response_format``."""
        return frozenset()

    @property
    def serves_adapters(self) -> bool:
        """Whether the engine serves the learner's LoRA adapter apart from the frozen base (vLLM with
        ``--lora-rank``): the learner then sends the adapter alone (``update_adapter``), not merged
        weights."""
        return False

    def update_adapter(self, adapter: Mapping[str, torch.Tensor], version: int) -> None:
        """Load a new LoRA adapter at ``version`` (only where ``serves_adapters``)."""
        raise NotImplementedError(f"{type(self).__name__} serves merged weights, not adapters")

    @property
    def adapters(self) -> tuple[str, ...]:
        """An adapter per agent: the adapters it serves on its frozen base, each with its own version; a
        request names one in ``SamplingParams.adapter``. None for an engine that serves one model."""
        return tuple(self._named)

    def adapter_version(self, name: str) -> int:
        """The version of adapter ``name``'s weights that new tokens of its requests are sampled from."""
        return named_version(name, self._named)

    def update_named_adapter(self, name: str, adapter: Mapping[str, torch.Tensor], version: int) -> None:
        """Load new weights of adapter ``name`` (an adapter per agent) at its own ``version``; the other
        adapters and the base stay as they are. Returns once they are live."""
        raise NotImplementedError(f"{type(self).__name__} serves no adapter per agent")

    def replica_status(self) -> list[dict[str, Any]]:
        """One entry per engine replica (``--engine-replicas``) for ``/v1/status``; none for one engine."""
        return []

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


def check_adapter(adapter: str | None, served: Mapping[str, int]) -> None:
    """A request's adapter must be one the engine serves (``served``: name -> version); none if it serves none."""
    if (adapter is not None or served) and adapter not in served:
        raise EngineError(f"no adapter {adapter!r} in this engine (it serves {', '.join(served) or 'no adapters'})")


def named_version(name: str, served: Mapping[str, int]) -> int:
    """The version of adapter ``name`` of ``served``; a ValueError naming the adapters if there is none."""
    if name not in served:
        raise ValueError(f"no adapter {name!r} here (adapters: {', '.join(served) or 'none'})")
    return served[name]
