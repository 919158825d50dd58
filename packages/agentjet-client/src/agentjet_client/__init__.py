"""AgentJet client: run unmodified agents anywhere and turn their LLM calls into training data."""

from agentjet_client.capture.episode import Episode, EpisodeHandle
from agentjet_client.capture.recorder import EpisodeRecorder
from agentjet_client.client import SwarmClient
from agentjet_client.delivery.spool import Spool, SpoolError
from agentjet_client.errors import AgentJetError, AgentLoadError, RejectedRequest, ServerError, ServerUnreachable
from agentjet_client.run.config import RunConfig
from agentjet_client.run.report import RunReport
from agentjet_client.run.runner import Runner
from agentjet_client.tasks.agent import SwarmAgent, swarm_agent
from agentjet_client.tasks.judges import GroupJudge, Judge, JudgeError
from agentjet_client.tasks.rewards import Rubric
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
