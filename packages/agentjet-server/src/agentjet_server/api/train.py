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

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agentjet_server.api.auth import authorize
from agentjet_server.api.context import read_json_object, runtime_of
from agentjet_server.errors import InvalidRequestError
from agentjet_server.learner.training import DataStep

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
    step = DataStep("sft" if mode == "sft" else "dpo", adapter, evaluate, lr, 0.1 if beta is None else float(beta))
    data = body.get("examples" if mode == "sft" else "pairs")
    answer = await asyncio.to_thread(runtime_of(request).training.run, step, data)
    return JSONResponse(answer)


ROUTES = [Route("/v1/train/sft", sft, methods=["POST"]), Route("/v1/train/dpo", dpo, methods=["POST"])]
