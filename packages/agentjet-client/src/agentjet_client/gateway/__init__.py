"""``agentjet-client gateway``: learn from a deployed agent's live traffic.

Point the agent's ``base_url`` at the gateway; its calls go on to the swarm server and come back as they
would, and each session (``X-AgentJet-Session``, the request's ``user``, or a Responses chain) becomes an
episode once ``POST /v1/feedback`` gives its reward. See docs/online.md.
"""

from agentjet_client.gateway.service import Gateway, GatewayConfig

__all__ = ["Gateway", "GatewayConfig"]
