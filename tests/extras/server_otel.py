"""agentjet-server[otel] alone: the server's request spans reach an OTLP/HTTP endpoint."""

from _smoke import Collector, Server

collector = Collector()
env = {
    "OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint,
    "OTEL_SERVICE_NAME": "smoke-server",
    "OTEL_BSP_SCHEDULE_DELAY": "200",
}
with Server(env=env) as server:
    server.chat()
    collector.wait(b"smoke-server")
print(f"otel: {len(collector.bodies)} OTLP post(s) from a served request")
