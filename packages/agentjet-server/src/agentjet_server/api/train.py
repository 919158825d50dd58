"""Training modes beside reinforcement learning, on the model the server serves (admin keys only).

``POST /v1/train/sft``: ``{"examples": [{"messages": [...], "tools": [...]}], "adapter": NAME,
"evaluate": false, "lr": 0.001}`` (``adapter``: with ``--adapters``; ``lr``: this update's learning rate,
the server's by default). The chats (the OpenAI messages format, tool calls included) are rendered with the
model's chat template, their assistant tokens trained with the negative log-likelihood
(``learner.supervised``), as one update of the learner thread between two policy updates: logged,
served and recorded as a step (its record's ``mode`` is "sft"), so reinforcement learning continues from
the new weights. With ``"evaluate": true`` nothing is updated and the answer is the loss alone (a
held-out part). ``agentjet-client sft DATA`` sends a file of chats this way.
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agentjet_server.api.auth import authorize
from agentjet_server.api.context import read_json_object, runtime_of
from agentjet_server.errors import ConflictError, InvalidRequestError

BODY_LIMIT = 32 * 1024 * 1024


async def sft(request: Request) -> Response:
    authorize(request, admin=True)
    body = await read_json_object(request, limit=BODY_LIMIT)
    unknown = sorted(set(body) - {"examples", "adapter", "evaluate", "lr"})
    if unknown:
        raise InvalidRequestError(
            f'unknown field "{unknown[0]}": the body is {{"examples": [...], "adapter": NAME, "evaluate": false, '
            '"lr": 0.001}',
            param=unknown[0],
        )
    adapter, evaluate, lr = body.get("adapter"), body.get("evaluate", False), body.get("lr")
    if lr is not None and (isinstance(lr, bool) or not isinstance(lr, int | float) or not 0 < lr < 1):
        raise InvalidRequestError('"lr" must be a learning rate between 0 and 1, e.g. 0.0001', param="lr")
    if adapter is not None and not isinstance(adapter, str):
        raise InvalidRequestError('"adapter" must be the name of one of the server\'s adapters', param="adapter")
    if not isinstance(evaluate, bool):
        raise InvalidRequestError('"evaluate" must be true or false', param="evaluate")
    answer = await asyncio.to_thread(_supervised, request, body.get("examples"), adapter, evaluate, lr)
    return JSONResponse(answer)


def _supervised(
    request: Request, examples: Any, adapter: str | None, evaluate: bool, lr: float | None
) -> dict[str, Any]:
    from agentjet_server.learner.loop import supervised_step
    from agentjet_server.learner.supervised import evaluate as evaluated
    from agentjet_server.learner.supervised import examples_batch

    rt = runtime_of(request)
    if rt.loop.learner is None:
        raise ConflictError("this server runs with --serve-only and trains nothing")
    names = rt.loop.trainer.config.adapters
    if (adapter is None) != (not names) or (adapter is not None and adapter not in names):
        wanted = f"one of its adapters ({', '.join(names)})" if names else "no adapter (it trains one model)"
        raise InvalidRequestError(f"this server's supervised steps name {wanted}, not {adapter!r}", param="adapter")
    batch = examples_batch(rt.engine.chat, examples)
    tokens = batch.trained_tokens
    if evaluate:
        total, count = rt.loop.requests.call(lambda: evaluated(rt.loop.trainer, batch, adapter)).result(timeout=3600)
        return {"mode": "sft", "evaluate": True, "loss": total / max(count, 1), "tokens": count, "adapter": adapter}
    stats = rt.loop.requests.call(lambda: supervised_step(rt.loop, batch, adapter, lr)).result(timeout=3600)
    version, step = rt.loop.live
    return {
        "mode": "sft",
        "evaluate": False,
        "loss": stats.extra.get("nll", stats.loss),
        "tokens": tokens,
        "examples": len(batch.sequences),
        "grad_norm": stats.grad_norm,
        "step": step,
        "policy_version": version,
        "adapter": adapter,
    }


ROUTES = [Route("/v1/train/sft", sft, methods=["POST"])]
