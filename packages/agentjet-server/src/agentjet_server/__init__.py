"""AgentJet server: serve a model through an OpenAI-compatible API and train it with GRPO.

The names below are imported on first use: ``import agentjet_server.ingest.bodies`` (the request-body
gate process) or ``agentjet-server status`` must not pay for torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentjet_server.app import create_app
    from agentjet_server.engine.base import Engine, SamplingParams, TokenEvent
    from agentjet_server.errors import AgentJetServerError, ConfigError, EngineError, ModelLoadError, RequestError
    from agentjet_server.runtime import SwarmRuntime
    from agentjet_server.settings import ServerSettings

__version__ = "0.1.0"

_HOMES = {
    "AgentJetServerError": "agentjet_server.errors",
    "ConfigError": "agentjet_server.errors",
    "Engine": "agentjet_server.engine.base",
    "EngineError": "agentjet_server.errors",
    "ModelLoadError": "agentjet_server.errors",
    "RequestError": "agentjet_server.errors",
    "SamplingParams": "agentjet_server.engine.base",
    "ServerSettings": "agentjet_server.settings",
    "SwarmRuntime": "agentjet_server.runtime",
    "TokenEvent": "agentjet_server.engine.base",
    "create_app": "agentjet_server.app",
}

__all__ = [
    "AgentJetServerError",
    "ConfigError",
    "Engine",
    "EngineError",
    "ModelLoadError",
    "RequestError",
    "SamplingParams",
    "ServerSettings",
    "SwarmRuntime",
    "TokenEvent",
    "create_app",
]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'agentjet_server' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value
