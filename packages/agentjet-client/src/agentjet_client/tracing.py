"""Traces across the swarm with OpenTelemetry (the ``otel`` extra): each episode is one trace.

The client opens an ``episode`` span per episode and a ``chat`` span per model call under it, and
passes the trace on in the call's HTTP headers (W3C ``traceparent``, and ``baggage`` with the
episode's id), through the capture proxy too; each trajectory carries its episode's
``traceparent``, so the server's ``ingest`` span and the learner's ``learner step`` span (which links
every trajectory it trained) join the same traces. The server uses this module too.

Nothing is recorded unless tracing is configured: ``configure()`` (both CLIs call it) installs an
OTLP exporter when the standard ``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_TRACES_EXPORTER`` variable is
set; ``use_provider`` installs any tracer provider (tests: an in-memory exporter). Without the
opentelemetry packages every function here does nothing.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from typing import Any

from agentjet_client.errors import extra_hint

logger = logging.getLogger(__name__)

try:
    from opentelemetry import baggage, propagate, trace
    from opentelemetry import context as otel_context
except ImportError:  # the otel extra is not installed: no traces
    trace = None  # type: ignore[assignment]

EPISODE_BAGGAGE = "agentjet.episode"
_KINDS = (
    {"client": trace.SpanKind.CLIENT, "server": trace.SpanKind.SERVER, "internal": trace.SpanKind.INTERNAL}
    if trace is not None
    else {}
)
_provider: Any = None  # set by ``use_provider``; else the process's global one


def enabled() -> bool:
    return trace is not None


def use_provider(provider: Any) -> None:
    """Record spans with ``provider`` (None: back to the process's global provider)."""
    global _provider
    _provider = provider


_tracers: dict[tuple[int, str], Any] = {}


def tracer(name: str) -> Any:
    """A tracer, or None without opentelemetry or while no tracer provider is configured (its spans would
    record nothing, and starting them costs a model call a tenth of a millisecond)."""
    if trace is None:
        return None
    provider = _provider or trace.get_tracer_provider()
    if isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
        return None
    key = (id(provider), name)
    found = _tracers.get(key)
    if found is None:
        found = _tracers[key] = provider.get_tracer(name)
    return found


def configure(service: str) -> bool:
    """Export spans over OTLP when the standard OpenTelemetry variables ask for it; True if so."""
    wanted = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_TRACES_EXPORTER")
    if not wanted or os.environ.get("OTEL_TRACES_EXPORTER") == "none":
        return False
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        logger.warning("OTEL_* is set, but no spans are exported: %s", extra_hint("tracing", "otel", exc))
        return False
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", service)})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    return True


@contextmanager
def span(
    name: str,
    *,
    parent: Any = None,
    kind: str = "internal",
    attributes: Mapping[str, Any] | None = None,
    links: list[Any] | None = None,
) -> Iterator[Any]:
    """A span, current inside (``parent``: a context to start it under instead of the current one).
    Yields the span (None without opentelemetry)."""
    tracer_ = tracer("agentjet")
    if tracer_ is None:
        yield None
        return
    with tracer_.start_as_current_span(
        name, context=parent, kind=_KINDS[kind], attributes=attributes, links=links
    ) as current:
        yield current


def current_context() -> Any:
    """The current trace context (to start spans under from another thread), or None."""
    return otel_context.get_current() if trace is not None else None


def with_episode(episode_id: str, ctx: Any = None) -> Any:
    """``ctx`` (the current context) with the episode's id as baggage, which the headers carry on."""
    if trace is None:
        return None
    return baggage.set_baggage(EPISODE_BAGGAGE, episode_id, context=ctx or otel_context.get_current())


def inject(headers: MutableMapping[str, str], ctx: Any = None) -> None:
    """Add the trace (``traceparent``, ``baggage``) of ``ctx`` or the current context to ``headers``."""
    if trace is not None:
        propagate.inject(headers, context=ctx)


def extract(headers: Mapping[str, str]) -> Any:
    """The trace context the headers carry (None without opentelemetry)."""
    return propagate.extract(headers) if trace is not None else None


def episode_of(ctx: Any) -> str | None:
    """The episode id in a context's baggage (set by the client), if any."""
    if trace is None or ctx is None:
        return None
    value = baggage.get_baggage(EPISODE_BAGGAGE, context=ctx)
    return str(value) if value else None


def traceparent(ctx: Any = None) -> str | None:
    """The W3C ``traceparent`` of ``ctx`` or the current context: what a trajectory carries."""
    headers: dict[str, str] = {}
    inject(headers, ctx)
    return headers.get("traceparent")


def link_to(parent: str | None, attributes: Mapping[str, Any] | None = None) -> Any:
    """A span link to the span a ``traceparent`` names (with ``attributes``), or None."""
    if trace is None or not parent:
        return None
    context = propagate.extract({"traceparent": parent})
    span_context = trace.get_current_span(context).get_span_context()
    return trace.Link(span_context, attributes=dict(attributes or {})) if span_context.is_valid else None


def start_episode(episode_id: str, attributes: Mapping[str, Any]) -> tuple[Any, Any]:
    """An ``episode`` span (a new trace, ended by the caller) and the context to start its calls' spans
    under (with the episode's id as baggage); ``(None, None)`` without opentelemetry."""
    tracer_ = tracer("agentjet")
    if tracer_ is None:
        return None, None
    root = tracer_.start_span("episode", context=otel_context.Context(), attributes=dict(attributes))
    ctx = trace.set_span_in_context(root, with_episode(episode_id, otel_context.Context()))
    return root, ctx


def ids(ctx: Any) -> tuple[str | None, str | None]:
    """``(trace_id, span_id)`` in hex of the span in ``ctx``, for log lines; Nones when not recording."""
    if trace is None or ctx is None:
        return None, None
    span_context = trace.get_current_span(ctx).get_span_context()
    if not span_context.is_valid:
        return None, None
    return f"{span_context.trace_id:032x}", f"{span_context.span_id:016x}"
