"""How the transformers engine turns one decode step's logits into tokens, and the requests it samples for.

``Sampler.sample`` takes the logits of every row of the running batch and, for each row still live,
picks its next token (greedy at temperature 0, else temperature and top-p with the request's own
generator, so a seed reproduces a completion), records it, and pushes it to the caller as a
``TokenEvent``: its log-probability under the model (temperature 1), the top log-probabilities asked
for, the policy version of the weights that produced the logits, and a finish reason on the last one.

Whatever goes wrong for one row stays in that row: a distribution that is not a distribution (its
settings made it non-finite) fails that request alone with a 400 naming the settings, any other error
its request alone with a 500; the other rows sample on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from agentjet_server.engine.base import FinishReason, SamplingParams, TokenEvent
from agentjet_server.engine.handoff import TokenStream
from agentjet_server.engine.tokens import ChatTokenizer
from agentjet_server.errors import EngineError, InvalidRequestError


@dataclass(kw_only=True)
class Request(TokenStream):
    """One completion in the transformers engine: its prompt, its parameters and what it sampled so far."""

    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    output_ids: list[int] = field(default_factory=list)


class Sampler:
    """Each live row's next token, pushed to its caller; knows when a completion is finished."""

    def __init__(self, chat: ChatTokenizer, max_context: int) -> None:
        self.chat = chat
        self.max_context = max_context
        self.tokens_sampled = 0

    def sample(self, batch: list[Request], live: list[bool], logits: torch.Tensor, version: int) -> torch.Tensor:
        """Each live row's next token (the pad token for the others); a row that finished, or whose caller
        went away, is marked dead in ``live``."""
        logprobs = torch.log_softmax(logits.float(), dim=-1).cpu()
        scores = logits.float().cpu()
        chosen = torch.full((len(batch),), self.chat.pad_id, dtype=torch.long)
        for i, request in enumerate(batch):
            if not live[i]:
                continue
            if request.cancelled:
                live[i] = False
                continue
            try:
                event = self._next(request, scores[i], logprobs[i], version)
            except InvalidRequestError as exc:  # this row's settings: its request fails, no other
                live[i] = False
                request.push(exc)
                continue
            except Exception as exc:  # a failure of this row only: the batch samples on
                live[i] = False
                request.push(EngineError(f"sampling failed: {type(exc).__name__}: {exc}"))
                continue
            chosen[i] = event.token_id
            if event.finish_reason is not None:
                live[i] = False
            self.tokens_sampled += 1
            request.push(event)
        return chosen

    def _next(self, request: Request, scores: torch.Tensor, logprobs: torch.Tensor, version: int) -> TokenEvent:
        token = self.pick(scores, request.params, request.generator)
        request.output_ids.append(token)
        top: list[tuple[int, float]] = []
        if request.params.top_logprobs:
            values, indices = logprobs.topk(request.params.top_logprobs)
            top = [(int(t), float(v)) for t, v in zip(indices, values, strict=True)]
        return TokenEvent(token, float(logprobs[token]), version, top, self.finish_reason(request, token))

    @staticmethod
    def pick(scores: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
        """A token from one row's logits: the argmax at temperature 0, else a draw from the tempered
        distribution cut to its top-``top_p`` mass."""
        if params.temperature <= 0.0:
            return int(scores.argmax())
        probs = torch.softmax(scores / params.temperature, dim=-1)
        if not bool(torch.isfinite(probs).all()):
            raise InvalidRequestError(
                f"temperature={params.temperature!r} with top_p={params.top_p!r} leaves no finite sampling "
                "distribution for this model; use a temperature of at least 1e-5 (below it is greedy)",
                param="temperature",
            )
        if params.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            keep = sorted_probs.cumsum(-1) - sorted_probs < params.top_p
            keep[0] = True
            filtered = torch.zeros_like(probs)
            filtered[order[keep]] = sorted_probs[keep]
            probs = filtered / filtered.sum()
        return int(torch.multinomial(probs, 1, generator=generator))

    def finish_reason(self, request: Request, token: int) -> FinishReason | None:
        """``stop`` at an end-of-turn token or a stop string, ``length`` at ``max_tokens`` or the
        model's context; None while the completion goes on."""
        if token in self.chat.stop_ids or self.chat.hits_stop_string(request.output_ids, request.params.stop):
            return "stop"
        if len(request.output_ids) >= request.params.max_tokens:
            return "length"
        if len(request.prompt_ids) + len(request.output_ids) >= self.max_context:
            return "length"
        return None
