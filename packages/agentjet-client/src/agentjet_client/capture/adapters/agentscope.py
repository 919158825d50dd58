"""``episode.agentscope()``: an AgentScope 2.x chat model whose calls are captured into the episode.

It is AgentScope's own ``OpenAIChatModel`` (streaming on, as AgentScope has it by default) with an
``OpenAICredential`` for the server's API, whose OpenAI client runs on the episode's capture HTTP
client for one agent (``Episode.agentscope`` passes it): AgentScope's agents, toolkits and
formatters work unchanged and each call is recorded, token-exact, as that agent.
"""

from __future__ import annotations

from typing import Any

from pydantic import SecretStr

from agentjet_client.errors import extra_hint


def chat_model(base_url: str, api_key: str, retries: int, **kwargs: Any) -> Any:
    try:
        from agentscope.credential import OpenAICredential
        from agentscope.model import OpenAIChatModel
    except ImportError as exc:
        raise ImportError(extra_hint("episode.agentscope()", "agentscope", exc)) from exc
    parameters = kwargs.pop("parameters", None)
    if parameters is None:
        known = {k: kwargs.pop(k) for k in ("max_tokens", "temperature", "top_p") if k in kwargs}
        parameters = OpenAIChatModel.Parameters(**known)
    kwargs.setdefault("model", "default")  # the server serves one model under any of its names
    kwargs.setdefault("max_retries", retries)
    credential = OpenAICredential(api_key=SecretStr(api_key), base_url=base_url)
    return OpenAIChatModel(credential, parameters=parameters, **kwargs)
