"""Automated research: studies of many training runs over a space of settings and agent code,
run unattended through the servers' and clients' public interfaces (``agentjet-client research``).
"""

from agentjet_client.research.runner import StudyRunner
from agentjet_client.research.study import Study, load_study

__all__ = ["Study", "StudyRunner", "load_study"]
