"""The two kinds of wire model, strict (our own types: an unknown field is an error) and open (OpenAI's
responses: extra fields kept), and the bounds of an integer on the wire."""

from __future__ import annotations

import json
import math
from typing import Any

from pydantic import BaseModel, ConfigDict


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


def _all_log_probabilities(values: list[Any]) -> bool:
    """Every item a finite number at most 1e-4 (checked by builtins, without a Python-level loop)."""
    return (
        set(map(type, values)) <= {int, float}
        and all(map(math.isfinite, values))
        and (not values or max(values) <= 1e-4)
    )


def _whole_numbers(value: Any, what: str) -> Any:
    """Check a long list of integers in one pass and fail at its first bad item, so a list of a
    million strings is one error, not a million (each would be rendered into the 400)."""
    if isinstance(value, list):
        # the common case checked by builtins (a 2k-token list in microseconds); the loop finds the culprit
        if set(map(type, value)) <= {int} and (not value or (min(value) >= 0 and max(value) <= INT64_MAX)):
            return value
        for i, x in enumerate(value):
            if type(x) is not int or not 0 <= x <= INT64_MAX:
                raise ValueError(
                    f"item {i} is {json.dumps(x, default=str)[:40]}: {what} are JSON integers from 0 to 2^63-1"
                )
    return value


def _log_probabilities(value: Any) -> Any:
    if isinstance(value, list):
        if _all_log_probabilities(value):
            return value
        for i, x in enumerate(value):
            if type(x) not in (int, float) or not math.isfinite(x) or x > 1e-4:
                raise ValueError(
                    f"item {i} is {json.dumps(x, default=str)[:40]}: completion_logprobs must be finite "
                    "log-probabilities (<= 0), one per completion token"
                )
    return value
