"""AgentJet server: serve a model through an OpenAI-compatible API and train it with GRPO."""

from agentjet_server.app import create_app
from agentjet_server.engine.base import Engine, SamplingParams, TokenEvent
from agentjet_server.errors import AgentJetServerError, ConfigError, EngineError, ModelLoadError, RequestError
from agentjet_server.runtime import SwarmRuntime
from agentjet_server.settings import ServerSettings

__version__ = "0.1.0"

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
