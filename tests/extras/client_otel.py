"""agentjet-client[otel] alone: spans of a captured call exported over OTLP/HTTP to a local endpoint."""

import os

from _smoke import Collector, server_url

collector = Collector()
os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = collector.endpoint
os.environ["OTEL_SERVICE_NAME"] = "smoke-client"

from opentelemetry import trace  # noqa: E402

from agentjet_client import SwarmClient, tracing  # noqa: E402

assert tracing.configure("agentjet-client"), "tracing.configure did not export with OTEL_* set"
with SwarmClient(server_url()) as client:
    episode = client.episode("smoke-otel")
    episode.openai().chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Write seven as a digit."}], max_tokens=4
    )
    episode.close()
    assert episode.recorder.failures == 0
trace.get_tracer_provider().force_flush()  # type: ignore[attr-defined]
collector.wait(b"smoke-client")
print(f"otel: {len(collector.bodies)} OTLP post(s) from a captured call")
