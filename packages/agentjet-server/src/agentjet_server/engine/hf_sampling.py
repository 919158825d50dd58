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

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from agentjet_server.engine.base import FinishReason, SamplingParams, TokenEvent
from agentjet_server.engine.grammar import Grammar
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
    grammar: Grammar | None = None  # response_format's matcher
    prompt_logprobs: list[float] | None = None  # scored before its prefill if its params ask for them


# the version of the weights a batch samples from: one for every row, or per adapter (an adapter per agent)
Versions = int | Mapping[str, int]


def version_for(request: Request, versions: Versions) -> int:
    """The version the tokens of ``request`` are sampled from."""
    if isinstance(versions, int):
        return versions
    return versions[request.params.adapter or ""]


PROCESSING = ("logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty", "top_k", "min_p")


def processing_of(params: SamplingParams) -> str:
    """The settings of ``params`` that change the distribution, as ``name=value`` (for messages)."""
    defaults = SamplingParams(max_tokens=1)
    named = [f"{n}={getattr(params, n)!r}" for n in PROCESSING if getattr(params, n) != getattr(defaults, n)]
    named += [f"min_tokens={params.min_tokens}"] if params.min_tokens else []
    named += [f"response_format={params.grammar[0]}"] if params.grammar else []
    return ", ".join([*named, f"temperature={params.temperature!r}"])


def first(params: SamplingParams) -> str:
    """The first setting of ``params`` that changes the distribution (an error's ``param``)."""
    if params.grammar:
        return "response_format"
    defaults = SamplingParams(max_tokens=1)
    return next((n for n in PROCESSING if getattr(params, n) != getattr(defaults, n)), "temperature")


class Sampler:
    """Each live row's next token, pushed to its caller; knows when a completion is finished."""

    def __init__(self, chat: ChatTokenizer, max_context: int) -> None:
        self.chat = chat
        self.max_context = max_context
        self.tokens_sampled = 0

    def sample(self, batch: list[Request], live: list[bool], logits: torch.Tensor, version: Versions) -> torch.Tensor:
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
                event = self._next(request, scores[i], logprobs[i], version_for(request, version))
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
        params = request.params
        behaviour: torch.Tensor | None = None
        if params.processed:
            scores = self.process(scores, request)
            behaviour = torch.log_softmax(scores, dim=-1)
            if not bool(torch.isfinite(behaviour.max())):
                raise InvalidRequestError(
                    f"the sampling settings {processing_of(params)} leave no token to sample", param=first(params)
                )
        token = self.pick(scores, params, request.generator)
        if request.grammar is not None:
            request.grammar.accept(token)
        request.output_ids.append(token)
        top: list[tuple[int, float]] = []
        if params.top_logprobs:
            values, indices = logprobs.topk(params.top_logprobs)
            top = [(int(t), float(v)) for t, v in zip(indices, values, strict=True)]
        finish = self.finish_reason(request, token)
        mu = None if behaviour is None else float(behaviour[token])
        scored = request.prompt_logprobs if len(request.output_ids) == 1 else None
        return TokenEvent(token, float(logprobs[token]), version, top, finish, mu, scored)

    def process(self, scores: torch.Tensor, request: Request) -> torch.Tensor:
        """The row's logits as its settings change them, in vLLM's order: the response_format grammar; logit
        bias; repetition, frequency and presence penalties; end tokens masked below ``min_tokens`` (or always,
        ``ignore_eos``); then the cuts, top-k and min-p (min-p on the temperature-1 distribution, so that every
        token the sampler can draw has a finite behaviour log-probability)."""
        p, out = request.params, scores.clone()
        if request.grammar is not None:  # first, as vLLM applies its structured-output bitmask
            request.grammar.mask(out)
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias])
            out[ids] += torch.tensor([b for _, b in p.logit_bias], dtype=out.dtype)
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(request.prompt_ids) | set(request.output_ids)), dtype=torch.long)
            values = out[seen]
            out[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and request.output_ids:
            counts = torch.bincount(torch.tensor(request.output_ids), minlength=out.shape[0])[: out.shape[0]]
            out -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
        if p.ignore_eos or len(request.output_ids) < p.min_tokens:
            out[sorted(self.chat.stop_ids)] = float("-inf")
        if 0 < p.top_k < out.shape[0]:
            out[out < out.topk(p.top_k).values[-1]] = float("-inf")
        if p.min_p > 0:
            probs = torch.softmax(out, dim=-1)
            out[probs < p.min_p * probs.max()] = float("-inf")
        return out

    @staticmethod
    def pick(scores: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
        """A token from one row's logits: the argmax at temperature 0, else a draw from the tempered
        distribution cut to its top-``top_p`` mass."""
        if params.temperature <= 0.0:
            return int(scores.argmax())
        probs = torch.softmax(scores / params.temperature, dim=-1)
        if not bool(torch.isfinite(probs).all()):
            raise InvalidRequestError(
                f"the sampling settings ({processing_of(params)}, top_p={params.top_p!r}) leave no finite sampling "
                "distribution for this model; a temperature below 1e-5 is greedy, larger biases and penalties "
                "overflow it",
                param=first(params),
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
