"""Training modes beside reinforcement learning, on the model the server serves (admin keys only).

``POST /v1/train/sft``: ``{"examples": [{"messages": [...], "tools": [...]}], "adapter": NAME,
"evaluate": false, "lr": 0.001}`` (``adapter``: with ``--adapters``; ``lr``: this update's learning rate,
the server's by default). The chats (the OpenAI messages format, tool calls included) are rendered with the
model's chat template, their assistant tokens trained with the negative log-likelihood
(``learner.supervised``), as one update of the learner thread between two policy updates: logged,
served and recorded as a step (its record's ``mode`` is "sft"), so reinforcement learning continues from
the new weights. With ``"evaluate": true`` nothing is updated and the answer is the loss alone (a
held-out part). ``agentjet-client sft DATA`` sends a file of chats this way.

``POST /v1/train/dpo``: ``{"pairs": [{"prompt": [...], "chosen": ..., "rejected": ..., "ref_chosen_logps":
-12.5, "ref_rejected_logps": -11.0}], "beta": 0.1, "adapter": NAME, "evaluate": false, "lr": 0.0001}``:
one DPO update on the pairs (``learner.preference``; the step's record's ``mode`` is "dpo"). With
``"evaluate": true`` nothing is updated: the answer holds each answer's summed log-prob under the current
weights (``chosen_logps``, ``rejected_logps``: what a pair's reference log-probs are, scored before the
first update) and, where the pairs carry their reference log-probs, the DPO figures (held-out pairs).
``agentjet-client dpo DATA`` sends a file of pairs this way.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agentjet_server.api.auth import authorize
from agentjet_server.api.context import read_json_object, runtime_of
from agentjet_server.errors import ConflictError, InvalidRequestError

BODY_LIMIT = 32 * 1024 * 1024


FIELDS = {"sft": '"examples": [...]', "dpo": '"pairs": [...], "beta": 0.1'}


async def sft(request: Request) -> Response:
    return await _train(request, "sft")


async def dpo(request: Request) -> Response:
    return await _train(request, "dpo")


async def _train(request: Request, mode: str) -> Response:
    authorize(request, admin=True)
    body = await read_json_object(request, limit=BODY_LIMIT)
    allowed = {"adapter", "evaluate", "lr", *(("examples",) if mode == "sft" else ("pairs", "beta"))}
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise InvalidRequestError(
            f'unknown field "{unknown[0]}": the body is {{{FIELDS[mode]}, "adapter": NAME, "evaluate": false, '
            '"lr": 0.001}',
            param=unknown[0],
        )
    adapter, evaluate, lr, beta = body.get("adapter"), body.get("evaluate", False), body.get("lr"), body.get("beta")
    if lr is not None and (isinstance(lr, bool) or not isinstance(lr, int | float) or not 0 < lr < 1):
        raise InvalidRequestError('"lr" must be a learning rate between 0 and 1, e.g. 0.0001', param="lr")
    if beta is not None and (isinstance(beta, bool) or not isinstance(beta, int | float) or not 0 < beta <= 100):
        raise InvalidRequestError('"beta" must be a number above 0 (and at most 100), e.g. 0.1', param="beta")
    if adapter is not None and not isinstance(adapter, str):
        raise InvalidRequestError('"adapter" must be the name of one of the server\'s adapters', param="adapter")
    if not isinstance(evaluate, bool):
        raise InvalidRequestError('"evaluate" must be true or false', param="evaluate")
    settings = _Settings(mode, adapter, evaluate, lr, 0.1 if beta is None else float(beta))
    answer = await asyncio.to_thread(_run, request, body, settings)
    return JSONResponse(answer)


@dataclass(frozen=True)
class _Settings:
    mode: str
    adapter: str | None
    evaluate: bool
    lr: float | None
    beta: float


def _run(request: Request, body: dict[str, Any], settings: _Settings) -> dict[str, Any]:
    from agentjet_server.learner.loop import score_batch, supervised_step
    from agentjet_server.learner.preference import pairs_batch
    from agentjet_server.learner.supervised import examples_batch

    rt = runtime_of(request)
    if rt.loop.learner is None:
        raise ConflictError("this server runs with --serve-only and trains nothing")
    names, adapter = rt.loop.trainer.config.adapters, settings.adapter
    if (adapter is None) != (not names) or (adapter is not None and adapter not in names):
        wanted = f"one of its adapters ({', '.join(names)})" if names else "no adapter (it trains one model)"
        message = f"this server's {settings.mode} steps name {wanted}, not {adapter!r}"
        raise InvalidRequestError(message, param="adapter")
    if settings.mode == "sft":
        batch, referenced = examples_batch(rt.engine.chat, body.get("examples")), False
    else:
        batch, referenced = pairs_batch(rt.engine.chat, body.get("pairs"), settings.beta, train=not settings.evaluate)
    for sequence in batch.sequences:
        sequence.adapter = adapter
    batch.lr = settings.lr
    tokens = batch.trained_tokens
    answer: dict[str, Any] = {"mode": settings.mode, "evaluate": settings.evaluate, "tokens": tokens}
    answer["adapter"] = adapter
    if settings.evaluate:
        scores = rt.loop.requests.call(lambda: score_batch(rt.loop, batch, adapter)).result(timeout=3600)
        if settings.mode == "sft":
            return {**answer, "loss": -sum(scores) / max(tokens, 1)}
        return {**answer, **_pair_figures(batch, scores, referenced)}
    stats = rt.loop.requests.call(lambda: supervised_step(rt.loop, batch, adapter)).result(timeout=3600)
    version, step = rt.loop.live
    answer.update(
        loss=stats.extra.get("nll", stats.loss),
        grad_norm=stats.grad_norm,
        step=step,
        policy_version=version,
        **({"examples": len(batch.sequences)} if settings.mode == "sft" else {"pairs": len(batch.sequences) // 2}),
    )
    answer.update({k: stats.extra[k] for k in ("reward_margin", "accuracy", "logp_margin") if k in stats.extra})
    return answer


def _pair_figures(batch: Any, scores: list[float], referenced: bool) -> dict[str, Any]:
    """A scored DPO batch: each answer's log-prob and, with the pairs' reference log-probs, the DPO figures."""
    import torch

    from agentjet_server.learner.losses import dpo_weights

    figures: dict[str, Any] = {
        "pairs": len(scores) // 2,
        "chosen_logps": scores[0::2],
        "rejected_logps": scores[1::2],
        "logp_margin": sum(scores[0::2]) / max(len(scores) // 2, 1) - sum(scores[1::2]) / max(len(scores) // 2, 1),
    }
    if referenced:
        reference = torch.tensor([math.fsum(s.old_logprobs) for s in batch.sequences], dtype=torch.float64)
        _, pair = dpo_weights(torch.tensor(scores, dtype=torch.float64), reference, batch.beta)
        figures.update(loss=pair["dpo_loss"], reward_margin=pair["reward_margin"], accuracy=pair["accuracy"])
    return figures


ROUTES = [Route("/v1/train/sft", sft, methods=["POST"]), Route("/v1/train/dpo", dpo, methods=["POST"])]
