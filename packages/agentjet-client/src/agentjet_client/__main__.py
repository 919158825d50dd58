"""``python -m agentjet_client``: the ``agentjet-client`` command."""

from agentjet_client.cli import main

main()
