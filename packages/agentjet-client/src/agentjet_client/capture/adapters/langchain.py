"""``episode.langchain()``: a LangChain chat model whose calls are captured into the episode.

It is langchain-openai's ``ChatOpenAI`` on the server's API whose HTTP clients are the episode's
capture clients for one agent (``Episode.langchain`` passes them), so ``invoke``, ``ainvoke``,
``stream``, ``bind_tools`` and tool-calling agent loops work unchanged and each call is recorded,
token-exact, as that agent. Behind the capture proxy (``ProxyEpisode``) the same model points at
the proxy's ``/episodes/<id>/<agent>/v1`` URL instead.
"""

from __future__ import annotations

from typing import Any

from pydantic import SecretStr

from agentjet_client.errors import extra_hint


def chat_model(base_url: str, api_key: str, retries: int, **kwargs: Any) -> Any:
    try:
        from langchain_openai import ChatOpenAI
    except ImportError as exc:
        raise ImportError(extra_hint("episode.langchain()", "langchain", exc)) from exc
    kwargs.setdefault("model", "default")  # the server serves one model under any of its names
    kwargs.setdefault("max_retries", retries)
    return ChatOpenAI(base_url=base_url, api_key=SecretStr(api_key), **kwargs)
