"""The checks a Tinker request gets where its route runs, so a bad one is a 400 at once: a datum's tokens and
inputs against its loss and the model, stable_reinforce's provenance against the sequences the server kept,
and an optimizer step's Adam parameters."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from agentjet_server.errors import InvalidRequestError
from agentjet_server.tinker import losses
from agentjet_server.tinker.store import Sequences
from agentjet_server.tinker.wire import Datum

ADAM_DEFAULTS = {
    "learning_rate": 1e-4,
    "beta1": 0.9,
    "beta2": 0.95,
    "eps": 1e-12,
    "weight_decay": 0.0,
    "grad_clip_norm": 0.0,
}


def check_datum(datum: Datum, index: int, loss_fn: str, vocab: int, max_context: int) -> None:
    n = len(datum.tokens)
    if not n or n > max_context:
        raise InvalidRequestError(f"datum {index} has {n} tokens; this model takes 1 to {max_context}")
    if min(datum.tokens) < 0 or max(datum.tokens) >= vocab:
        raise InvalidRequestError(f"datum {index}: a token id outside this model's vocabulary (0..{vocab - 1})")
    allowed = set(losses.REQUIRED[loss_fn]) | losses.OPTIONAL.get(loss_fn, set())
    for name in losses.REQUIRED[loss_fn]:
        if name not in datum.inputs:
            raise InvalidRequestError(
                f"datum {index}: {loss_fn} needs loss_fn_inputs[{name!r}]", param="loss_fn_inputs"
            )
    for name, array in datum.inputs.items():
        if name not in allowed:
            raise InvalidRequestError(
                f"datum {index}: loss_fn_inputs[{name!r}] is not an input of {loss_fn} "
                f"(its inputs: {', '.join(sorted(allowed))})",
                param="loss_fn_inputs",
            )
        if array.ndim == 0 or array.shape[0] != n:
            raise InvalidRequestError(
                f"datum {index}: loss_fn_inputs[{name!r}] has shape {list(array.shape)}, but the datum has {n} "
                "input tokens (targets, weights and the rest give one value per input position)",
                param="loss_fn_inputs",
            )
        if array.dtype.kind == "f" and not np.isfinite(array).all():
            raise InvalidRequestError(f"datum {index}: loss_fn_inputs[{name!r}] holds a value that is not finite")
    targets = datum.inputs["target_tokens"]
    if targets.ndim > 2 or (targets.size and (targets.min() < 0 or targets.max() >= vocab)):
        raise InvalidRequestError(
            f"datum {index}: target_tokens must be ids of this model's vocabulary (0..{vocab - 1})"
        )
    for name in ("weights", "advantages", "logprobs", "mask", *losses.THRESHOLDS):
        if name in datum.inputs and datum.inputs[name].shape != targets.shape:
            raise InvalidRequestError(
                f"datum {index}: loss_fn_inputs[{name!r}] has shape {list(datum.inputs[name].shape)}, "
                f"target_tokens {list(targets.shape)}: they must match",
                param="loss_fn_inputs",
            )


def resolve_provenance(sequences: Sequences, datum: Datum, index: int) -> None:
    """stable_reinforce: each target token is where its provenance says it came from, and its sampler
    log-probability is the one the server kept (the client's own copy is not trusted)."""
    if not datum.target_spans:
        raise InvalidRequestError(
            f"datum {index}: stable_reinforce needs provenance on every datum (Datum.with_provenance; the cookbook "
            "adds it when its sampling clients record stability info)",
            param="loss_fn_input_spans",
        )
    targets = datum.inputs["target_tokens"].reshape(-1).tolist()
    mu = datum.inputs["logprobs"].astype(np.float32).reshape(-1).copy()
    position = 0
    for span in datum.target_spans:
        kept = sequences.get(span.sequence_id)
        source = kept.tokens if span.sampled else kept.prompt
        end = span.offset + span.length
        if end > len(source) or targets[position : position + span.length] != source[span.offset : end]:
            raise InvalidRequestError(
                f"datum {index}: target tokens {position}..{position + span.length - 1} are not the "
                f"{'sampled' if span.sampled else 'prompt'} tokens {span.offset}..{end - 1} of sequence "
                f"{span.sequence_id} as this server sampled it",
                param="loss_fn_input_spans",
            )
        if span.sampled:
            mu[position : position + span.length] = kept.logprobs[span.offset : end]
        position += span.length
    if position != len(targets):
        raise InvalidRequestError(f"datum {index}: the provenance spans cover {position} of {len(targets)} targets")
    datum.inputs["logprobs"] = mu


def adam_params(body: dict[str, Any]) -> dict[str, float]:
    """An ``optim_step``'s Adam parameters, the SDK's defaults where it leaves one out."""
    given = body.get("adam_params") or body.get("optim_params") or {}
    if not isinstance(given, dict) or given.get("type", "adam") not in ("adam", "adamw"):
        raise InvalidRequestError("optim_step takes adam_params (this server's clients use AdamW)", param="adam")
    params = {**ADAM_DEFAULTS}
    for key, value in given.items():
        if key == "type":
            continue
        if (
            key not in params
            or isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise InvalidRequestError(
                f"adam_params {key!r}: the keys are {', '.join(ADAM_DEFAULTS)}, numbers", param=key
            )
        params[key] = float(value)
    if not params["learning_rate"] >= 0 or not 0 <= params["beta1"] < 1 or not 0 <= params["beta2"] < 1:
        raise InvalidRequestError("adam_params: learning_rate >= 0 and betas in [0, 1)", param="adam_params")
    return params
