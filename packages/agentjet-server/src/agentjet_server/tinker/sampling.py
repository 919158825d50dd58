"""Sampling for the Tinker API on the workbench's model: ``num_samples`` rows of one prompt decoded together
with a KV cache, each token's log-probability under the model itself (temperature 1, what a trainer's ratio
compares against, whatever temperature picked the token), the prompt's log-probabilities from the same
prefill (``compute_logprobs``), top-k log-probabilities where asked. Stops: the model's end-of-sequence tokens
unless the request names its own stop tokens (an empty list: none) or stop strings; the stop token is part
of the sequence.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from agentjet_server.engine.base import SamplingParams
from agentjet_server.engine.hf_sampling import Sampler
from agentjet_server.tinker.wire import SampleAsk, Sampled, SampleResult

MAX_ROWS = 256  # sample requests batched together hold at most this many rows


@dataclass(frozen=True)
class SampleJob:
    sampler_id: str
    ask: SampleAsk
    sequence_ids: list[str]


def merge_key(job: SampleJob) -> tuple[Any, ...] | None:
    """What sample requests must share to run as one batch (None: this one runs alone, its seed its own)."""
    if job.ask.seed is not None:
        return None
    return (job.sampler_id, repr(dataclasses.replace(job.ask, num_samples=0)))


def split(result: SampleResult, counts: list[int]) -> list[SampleResult]:
    """A batched result as each request's: its own sequences, the prompt's log-probabilities for each."""
    parts, start = [], 0
    for count in counts:
        parts.append(SampleResult(result.sequences[start : start + count], result.prompt_logprobs, result.topk_prompt))
        start += count
    return parts


def _new_cache(model: Any) -> tuple[str, Any]:
    """A KV cache the forward passes fill in place, and the name the model's forward gives it (transformers
    renamed ``past_key_values`` to ``cache``)."""
    from transformers import DynamicCache

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    kwarg = "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"
    return kwarg, DynamicCache(config=base.config)


def prompt_logprobs(logits: torch.Tensor, prompt: list[int], last_n: int | None) -> np.ndarray:
    """Each prompt token's log-probability given the ones before it (NaN for the first, and for those before
    the last ``last_n``)."""
    logp = torch.log_softmax(logits[:-1].float(), dim=-1)
    chosen = logp.gather(1, torch.tensor(prompt[1:], device=logits.device)[:, None])[:, 0]
    out = np.full(len(prompt), math.nan, dtype=np.float32)
    out[1:] = chosen.cpu().numpy()
    if last_n is not None:
        out[: len(prompt) - last_n] = math.nan
    return out


def _pick(logits: torch.Tensor, ask: SampleAsk, generator: torch.Generator) -> torch.Tensor:
    """Each row's next token: top-k cut, then the engine's own pick (greedy at temperature 0, else the tempered
    distribution cut to its top-p mass)."""
    params = SamplingParams(max_tokens=ask.max_tokens, temperature=ask.temperature, top_p=ask.top_p)
    picked = []
    for row in logits:
        if 0 < ask.top_k < row.shape[0]:
            row = row.masked_fill(row < row.topk(ask.top_k).values[-1], -math.inf)
        picked.append(Sampler.pick(row.cpu(), params, generator))
    return torch.tensor(picked, device=logits.device)


@torch.no_grad()
def sample(model: Any, ask: SampleAsk, eos: set[int], decode: Callable[[list[int]], str]) -> SampleResult:
    device = next(model.parameters()).device
    generator = torch.Generator()
    if ask.seed is not None:
        generator.manual_seed(int(ask.seed))
    else:
        generator.seed()
    rows = ask.num_samples
    ids = torch.tensor([ask.prompt] * rows, device=device)
    kwarg, cache = _new_cache(model)
    out = model(input_ids=ids, use_cache=True, **{kwarg: cache})
    logits = out.logits[:, -1].float()
    result = SampleResult([])
    if ask.prompt_logprobs or ask.prompt_logprobs_last_n is not None:
        result.prompt_logprobs = prompt_logprobs(out.logits[0], ask.prompt, ask.prompt_logprobs_last_n)
    stops = eos if ask.stop_tokens is None else set(ask.stop_tokens)
    tokens: list[list[int]] = [[] for _ in range(rows)]
    logprobs: list[list[float]] = [[] for _ in range(rows)]
    topk: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(rows)]
    stopped, live = [False] * rows, [True] * rows
    for step in range(ask.max_tokens):
        logp = torch.log_softmax(logits, dim=-1)
        picked = _pick(logits, ask, generator)
        chosen = logp.gather(1, picked[:, None])[:, 0].cpu().tolist()
        best = torch.topk(logp, ask.topk_sample, dim=-1) if ask.topk_sample else None
        for row, token in enumerate(picked.cpu().tolist()):
            if not live[row]:
                continue
            tokens[row].append(token)
            logprobs[row].append(chosen[row])
            if best is not None:
                topk[row].append((best.indices[row].cpu().numpy(), best.values[row].cpu().numpy()))
            if token in stops or (ask.stop_strings and _ends_with_stop(tokens[row], ask.stop_strings, decode)):
                stopped[row], live[row] = True, False
        if not any(live) or step == ask.max_tokens - 1:
            break
        logits = model(input_ids=picked[:, None], use_cache=True, **{kwarg: cache}).logits[:, -1].float()
    for row in range(rows):
        k = (np.stack([t[0] for t in topk[row]]), np.stack([t[1] for t in topk[row]])) if topk[row] else None
        result.sequences.append(Sampled(tokens[row], logprobs[row], stopped[row], k))
    return result


def _ends_with_stop(tokens: list[int], stops: list[str], decode: Callable[[list[int]], str]) -> bool:
    longest = max(len(s) for s in stops)
    tail = decode(tokens[-(longest + 8) :])
    return any(s and s in tail for s in stops)
