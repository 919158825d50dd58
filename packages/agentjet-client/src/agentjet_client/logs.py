"""Log lines for people and for log pipelines (``--log-format text|json`` on both CLIs).

``json`` writes one JSON object per line: ``ts``, ``level``, ``logger``, ``message`` (``exc`` with a
traceback), and the ids of what the line is about: ``run_id``, ``episode_id``, ``trajectory_id``,
``task_id``, ``trace_id``, ``span_id``, each null when the line is about none. The ids come from
``log_context``, which sets them for the code it wraps (a context variable: each asyncio task and
each ``asyncio.to_thread`` call keeps its own), so an episode's lines carry its ids wherever they
are logged. The server uses this module too.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Literal

IDS = ("run_id", "episode_id", "trajectory_id", "task_id", "trace_id", "span_id")
LogFormat = Literal["text", "json"]
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

_context: ContextVar[dict[str, str]] = ContextVar("agentjet_log_context", default={})  # noqa: B039 (never mutated)


@contextmanager
def log_context(**ids: str | None) -> Iterator[None]:
    """Lines logged inside carry ``ids`` (those not None) besides the ones already set."""
    token = _context.set({**_context.get(), **{k: v for k, v in ids.items() if v is not None}})
    try:
        yield
    finally:
        _context.reset(token)


def bind_ids(**ids: str | None) -> None:
    """Lines logged from here to the end of the current asyncio task (or thread) carry ``ids``: for code
    that runs as a task of its own, an episode."""
    _context.set({**_context.get(), **{k: v for k, v in ids.items() if v is not None}})


def current_ids() -> dict[str, str]:
    return dict(_context.get())


class JsonFormatter(logging.Formatter):
    """A line of JSON per record; ``static`` ids (the run's) are on every line unless the context has its own."""

    def __init__(self, static: dict[str, str] | None = None) -> None:
        super().__init__()
        self.static = dict(static or {})

    def format(self, record: logging.LogRecord) -> str:
        ids = {**self.static, **_context.get()}
        line: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        line.update({key: ids.get(key) for key in IDS})
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False, default=str)


def json_handler(stream: Any = None, static: dict[str, str] | None = None) -> logging.Handler:
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter(static))
    return handler


def set_static_ids(**ids: str) -> None:
    """Ids every line of this process carries (the run's): given to each JSON handler of the root logger."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler.formatter, JsonFormatter):
            handler.formatter.static.update(ids)


def configure_logging(level: str, fmt: LogFormat = "text", handler: logging.Handler | None = None) -> None:
    """The root logger at ``level``: JSON lines on stderr, or ``handler`` (a terminal's), or plain text lines."""
    if fmt == "json":
        logging.basicConfig(level=level.upper(), handlers=[json_handler()])
    elif handler is not None:
        logging.basicConfig(level=level.upper(), handlers=[handler])
    else:
        logging.basicConfig(level=level.upper(), format=TEXT_FORMAT)


def console_logging(level: str, console: Any, fmt: LogFormat = "text") -> None:
    """``configure_logging`` for a command that draws on ``console`` (a rich ``Console``): on a terminal, in
    text, log lines go above its live progress line, not through it."""
    handler: logging.Handler | None = None
    if console.is_terminal and fmt == "text":
        from rich.logging import RichHandler

        handler = RichHandler(console=console, show_path=False, markup=False)
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    configure_logging(level, fmt, handler)
