"""Inference engines behind one interface (see ``base``)."""

from agentjet_server.engine.base import Engine, SamplingParams, TokenEvent

__all__ = ["Engine", "SamplingParams", "TokenEvent"]
