"""``python -m agentjet_server`` (what torchrun launches): the ``agentjet-server`` command."""

from agentjet_server.cli import main

if __name__ == "__main__":
    main()
