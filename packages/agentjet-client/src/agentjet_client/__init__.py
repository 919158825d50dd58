"""AgentJet client: run unmodified agents anywhere and turn their LLM calls into training data."""

from agentjet_client.agent import SwarmAgent, swarm_agent
from agentjet_client.capture import EpisodeRecorder
from agentjet_client.client import SwarmClient
from agentjet_client.episode import Episode, EpisodeHandle
from agentjet_client.errors import AgentJetError, AgentLoadError, RejectedRequest, ServerError, ServerUnreachable
from agentjet_client.judges import GroupJudge, Judge, JudgeError
from agentjet_client.report import RunReport
from agentjet_client.rewards import Rubric
from agentjet_client.runconfig import RunConfig
from agentjet_client.runner import Runner
from agentjet_client.spool import Spool, SpoolError
from agentjet_client.version import __version__ as __version__

__all__ = [
    "AgentJetError",
    "AgentLoadError",
    "Episode",
    "EpisodeHandle",
    "EpisodeRecorder",
    "GroupJudge",
    "Judge",
    "JudgeError",
    "RejectedRequest",
    "Rubric",
    "RunConfig",
    "RunReport",
    "Runner",
    "ServerError",
    "ServerUnreachable",
    "Spool",
    "SpoolError",
    "SwarmAgent",
    "SwarmClient",
    "swarm_agent",
]
