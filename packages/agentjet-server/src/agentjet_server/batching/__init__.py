"""Batching of trajectories into GRPO groups."""

from agentjet_server.batching.buffer import GroupBuffer

__all__ = ["GroupBuffer"]
