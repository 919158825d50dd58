"""``episode.anthropic()`` / ``episode.async_anthropic()``: Anthropic SDK clients whose calls are captured.

The server speaks Anthropic's Messages API (``POST /v1/messages``, plain and streamed, with tools),
so an agent written for Claude (the Anthropic SDK, or a harness built on it) trains unchanged. The
SDK's HTTP client is the episode's capture client for one agent; the SDK adds ``/v1/messages`` to
its base URL, so the base is the agent's server (or capture-proxy path) without its ``/v1``.
"""

from __future__ import annotations

from typing import Any

from agentjet_client.errors import extra_hint


def _sdk() -> Any:
    try:
        import anthropic
    except ImportError as exc:
        raise ImportError(extra_hint("episode.anthropic()", "anthropic", exc)) from exc
    return anthropic


def root(v1_base: str) -> str:
    """An OpenAI-style ``.../v1`` base URL as the Anthropic SDK's base (it adds ``/v1`` itself)."""
    return v1_base.rstrip("/").removesuffix("/v1")


def client(v1_base: str, api_key: str, retries: int, *, asynchronous: bool, **kwargs: Any) -> Any:
    sdk = _sdk()
    kwargs.setdefault("max_retries", retries)
    make = sdk.AsyncAnthropic if asynchronous else sdk.Anthropic
    return make(base_url=root(v1_base), api_key=api_key, **kwargs)
