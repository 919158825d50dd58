"""Ready-made model objects for agent frameworks, all pointed at the episode's capture proxy.

Each is an optional extra of agentjet-client (``pip install 'agentjet-client[langchain]'``); the core
imports none of them.
"""
