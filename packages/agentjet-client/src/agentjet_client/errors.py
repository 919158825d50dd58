"""The client's exceptions, rooted in one class.

    AgentJetError
    ├── ServerError          the server answered with an error (status_code, message)
    │   ├── RejectedRequest  a 4xx: the request itself is wrong; retrying will not help
    │   └── ServerStarting   a 503 from a server still starting (building or loading its model)
    ├── ServerUnreachable    no answer from the server (after retries)
    ├── AgentLoadError       the code dir has no usable @swarm_agent, or it fails to import
    ├── TaskLoadError        the agent's tasks could not be loaded (its own traceback in the message)
    └── StudyError           a research study file is invalid, or its --out dir belongs to another

Capture never raises into agent code: its failures are logged and counted on the recorder.
"""

from __future__ import annotations


class AgentJetError(Exception):
    """Base of everything the client raises on purpose."""


class ServerError(AgentJetError):
    """The server answered with an error status (``status_code``) and this message."""

    def __init__(self, status_code: int, message: str) -> None:
        super().__init__(f"server answered {status_code}: {message}")
        self.status_code = status_code
        self.message = message


class RejectedRequest(ServerError):
    """The server refused the request as invalid (4xx)."""


class ServerStarting(ServerError):
    """The server listens but is still starting; the message says what it is doing."""


class ServerUnreachable(AgentJetError):
    """The server could not be reached."""


class AgentLoadError(AgentJetError):
    """The agent code could not be loaded."""


class TaskLoadError(AgentJetError):
    """Loading an agent's tasks raised: the message holds the traceback of the agent's own frames."""


class StudyError(AgentJetError):
    """A study file is invalid, or a study's output directory cannot be used as asked."""
