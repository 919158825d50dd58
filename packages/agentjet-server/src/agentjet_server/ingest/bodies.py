"""Request bodies: read within a size and time limit, parse, check the shape, validate — each step
bounded before the next, more expensive one runs.

A hostile or broken client can send a body that is cheap to send and expensive to take apart: a
list of millions of items (one validation error each), JSON nested a thousand levels deep (the
parser and every later walk recurse), integers of thousands of digits, text with lone UTF-16
surrogates (no tokenizer or JSON encoder accepts them), or bytes that trickle in forever. So:

1. the body is read up to ``limit`` bytes (413 beyond) within ``timeout`` seconds (408 after);
2. bodies over ``INLINE_BYTES`` are parsed and validated in a worker thread, so the event loop
   keeps answering other requests meanwhile;
3. ``check_shape`` walks the parsed JSON once, iteratively: nesting deeper than ``MAX_DEPTH`` and
   strings that are not valid Unicode are refused, naming where they are;
4. the wire models bound every list (``max_length`` stops at the first surplus item), and a
   validation failure is reported by its first few problems only;
5. a body over ``GATE_BYTES`` is judged first by a helper process (``body_gate``), so a hostile
   one never costs the server's own memory or lock; at most ``LARGE_IN_FLIGHT`` are held at once.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Protocol, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_core import InitErrorDetails
from starlette.requests import ClientDisconnect, Request

from agentjet_client.protocol import MAX_BATCH_TRAJECTORIES, Trajectory, TrajectoryBatch
from agentjet_server.errors import InvalidRequestError, PayloadTooLargeError, RequestTimeoutError

M = TypeVar("M", bound=BaseModel)

MAX_DEPTH = 64  # the deepest legitimate bodies (tool schemas) use about ten levels
GATE_BYTES = 64 * 1024  # larger bodies are judged by the gate process first (``body_gate``)
LARGE_IN_FLIGHT = 2  # large bodies held at once; more wait unread
INLINE_BYTES = 32 * 1024  # smaller bodies are parsed on the event loop: a thread would cost more
SHOWN_PROBLEMS = 5
SHOWN_CHARACTERS = 80  # of a value quoted in a validation message


def describe_validation_error(exc: ValidationError) -> tuple[str, str | None]:
    """The first few problems, one readable sentence each (``messages.0.role: Input should be ...``),
    and the field of the first. Rendering every problem of a huge body would cost more than the body."""
    errors = exc.errors(include_url=False, include_context=False)[:SHOWN_PROBLEMS]
    parts = []
    for err in errors:
        loc = ".".join(str(x) for x in err["loc"]) or "body"
        if err["type"] == "extra_forbidden":
            parts.append(f"{loc}: unknown field; remove it or check its spelling")
        elif err["type"] == "missing":
            parts.append(f"{loc}: required field is missing")
        else:
            parts.append(f"{loc}: {str(err['msg']).removeprefix('Value error, ')}{_shown(err.get('input'))}")
    more = exc.error_count() - len(errors)
    if more > 0:
        parts.append(f"... and {more} more problems")
    first = ".".join(str(x) for x in errors[0]["loc"]) if errors else None
    return "invalid request: " + "; ".join(parts), first or None


def _shown(value: Any) -> str:
    """What the caller sent, briefly: containers by size only; text quoted and numbers as written, each cut
    at ``SHOWN_CHARACTERS`` (then quoted, so the quotes stay) with ``...`` after it where cut."""
    if isinstance(value, dict | list):
        return f" (got a {'JSON object' if isinstance(value, dict) else 'list'} of {len(value)} items)"
    if isinstance(value, bool | int | float) or value is None:
        written = json.dumps(value)
        shown, cut = written[:SHOWN_CHARACTERS], len(written) > SHOWN_CHARACTERS
    else:
        text = value if isinstance(value, str) else str(value)
        shown, cut = json.dumps(text[:SHOWN_CHARACTERS]), len(text) > SHOWN_CHARACTERS
    return f" (got {shown}{'...' if cut else ''})"


def _where(path: str, key: object) -> str:
    return f"{path}.{key}" if path else str(key)


_CONTAINERS_OR_TEXT = {str, dict, list}


def check_shape(data: Any, max_depth: int = MAX_DEPTH) -> None:
    """Refuse JSON nested deeper than ``max_depth`` or holding strings that are not valid Unicode
    (lone surrogates, from ``"\\ud800"`` escapes or raw bytes ED A0 80). One iterative pass."""
    stack: list[tuple[Any, int, str]] = [(data, 0, "")]
    while stack:
        node, depth, path = stack.pop()
        if depth > max_depth:
            raise InvalidRequestError(
                f"{path or 'body'}: JSON nested deeper than {max_depth} levels; flatten the structure",
                param=path.split(".")[0] or None,
                code="too_deep",
            )
        if isinstance(node, list) and not _CONTAINERS_OR_TEXT & set(map(type, node)):
            continue  # numbers only (token ids, log-probs): nothing to check, seen without a Python loop
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            if isinstance(key, str):
                _check_text(key, path)
            if isinstance(value, str):
                _check_text(value, _where(path, key))
            elif isinstance(value, dict | list):
                # paths are spelled out near the top only: deep inside, the prefix names the field
                stack.append((value, depth + 1, _where(path, key) if depth < 6 else path))


def _check_text(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            f"{where or 'body'}: text holds a lone UTF-16 surrogate ({text[exc.start]!a} at character {exc.start}), "
            "which is not valid Unicode; send UTF-8 text",
            param=where.split(".")[0] or None,
            code="invalid_unicode",
        ) from None


def parse_json(raw: bytes) -> dict[str, Any]:
    if not raw:
        raise InvalidRequestError("request body is empty; send a JSON object")
    try:
        data = json.loads(raw)
    except RecursionError:
        raise InvalidRequestError(
            f"request body is nested too deeply to parse; at most {MAX_DEPTH} levels are accepted", code="too_deep"
        ) from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, integers of more than 4300 digits
        raise InvalidRequestError(f"request body is not valid JSON: {str(exc)[:200]}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise InvalidRequestError(f"request body must be a JSON object, not {type(data).__name__}")
    check_shape(data)
    return data


def _itemwise(data: dict[str, Any], field: str, item: type[BaseModel], model: type[BaseModel]) -> None:
    """Validate ``data[field]`` item by item, stopping at the first bad one: a batch of a thousand
    broken items is reported by the first few problems of its first bad item, not by every problem
    of every item. Validated items replace the raw ones (the model takes them as they are)."""
    items = data.get(field)
    if not isinstance(items, list) or len(items) > MAX_BATCH_TRAJECTORIES:
        return  # the model's own validation says what is wrong
    for i, raw in enumerate(items):
        try:
            items[i] = item.model_validate(raw)
        except ValidationError as exc:
            details: list[InitErrorDetails] = [
                {"type": e["type"], "loc": (field, i, *e["loc"]), "input": e["input"], "ctx": e.get("ctx", {})}
                for e in exc.errors(include_url=False)[:SHOWN_PROBLEMS]
            ]
            raise ValidationError.from_exception_data(model.__name__, details) from None


def parse_model(raw: bytes, model: type[M]) -> M:
    """Parse, shape-check and validate ``raw`` as ``model`` (``RequestError`` or ``ValidationError``)."""
    data = parse_json(raw)
    if model is TrajectoryBatch:
        _itemwise(data, "trajectories", Trajectory, model)
    return model.model_validate(data)


async def read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The whole body, at most ``limit`` bytes, arriving within ``timeout`` seconds."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLargeError(
            f"request body is {declared} bytes; the limit is {limit} bytes. Send smaller batches",
            code="payload_too_large",
        )
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise PayloadTooLargeError(
                        f"request body exceeds the limit of {limit} bytes. Send smaller batches",
                        code="payload_too_large",
                    )
                chunks.append(chunk)
    except TimeoutError:
        raise RequestTimeoutError(
            f"the request body did not arrive within {timeout:g}s ({size} bytes came); send it at once",
            code="body_timeout",
        ) from None
    except ClientDisconnect:
        raise RequestTimeoutError("the client closed the connection before the body was complete") from None
    return b"".join(chunks)


class Gate(Protocol):
    """Judges a large body elsewhere (``body_gate.BodyGate``): None if valid, else the 400's fields."""

    def judge(self, raw: bytes, model: type[BaseModel]) -> dict[str, Any] | None: ...


async def read_model(
    request: Request,
    model: type[M],
    limit: int,
    timeout: float,
    gate: Gate | None = None,
    large: asyncio.Semaphore | None = None,
) -> M:
    """Read, size-check and validate a JSON body; large ones off the event loop. With a ``gate``,
    a body over ``GATE_BYTES`` is judged there first (only a valid one is parsed here), and at most
    ``large``'s count of such bodies are held at once (the rest wait, unread)."""
    declared = request.headers.get("content-length")
    if large is not None and (declared is None or not declared.isdigit() or int(declared) > GATE_BYTES):
        async with large:
            return await _read_and_parse(request, model, limit, timeout, gate)
    return await _read_and_parse(request, model, limit, timeout, gate)


async def _read_and_parse(request: Request, model: type[M], limit: int, timeout: float, gate: Gate | None) -> M:
    raw = await read_body(request, limit, timeout)
    if len(raw) <= INLINE_BYTES:
        return parse_model(raw, model)
    if gate is not None and len(raw) > GATE_BYTES:
        verdict = await asyncio.to_thread(gate.judge, raw, model)
        if verdict is not None:
            raise InvalidRequestError(verdict["message"], param=verdict.get("param"), code=verdict.get("code"))
    return await asyncio.to_thread(parse_model, raw, model)
