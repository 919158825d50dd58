"""``agentjet-client mcp``: a Model Context Protocol server (the official ``mcp`` package's FastMCP)
that lets a coding agent drive studies and training runs: the operations of ``tools.Workspace``,
over stdio (the agent starts this command) or streamable HTTP (``--http``).

Configure a coding agent with, for example::

    {"mcpServers": {"agentjet": {"command": "agentjet-client", "args": ["mcp", "--root", "/path/to/work"]}}}
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentjet_client.errors import extra_hint
from agentjet_client.research.tools import ToolError, Workspace

INSTRUCTIONS = (
    "AgentJet: reinforcement learning of LLM agents. A study (a TOML file; `agentjet-client research run`) trains "
    "many runs of an agent over a space of settings, each run a server that learns and a client that plays "
    "episodes. Use list_studies / study_status to follow studies, start_study / stop_study to run them, "
    "read_report for findings; runs are named STUDY_DIR/tNNN (list_runs) or by a server URL: run_status, "
    "run_metrics, recent_trajectories read them, set_live_setting / pause_run / resume_run steer them. Paths are "
    "relative to the workspace root."
)


Tool = Callable[[Callable[..., Any]], Callable[..., Any]]  # FastMCP's tool decorator


def build_server(workspace: Workspace, host: str = "127.0.0.1", port: int = 8765) -> Any:
    """The FastMCP server with every tool of ``workspace``."""
    try:
        from mcp.server.fastmcp import FastMCP
    except ImportError as exc:
        raise ToolError(extra_hint("the MCP server", "mcp", exc)) from exc

    server = FastMCP("agentjet", instructions=INSTRUCTIONS, host=host, port=port, log_level="WARNING")

    tool = server.tool()  # a ToolError raised by a tool becomes its error answer, with its message
    _study_tools(tool, workspace)
    _run_tools(tool, workspace)
    return server


def _study_tools(tool: Tool, workspace: Workspace) -> None:
    """The tools on studies: list, status, check, start, stop, the report, the workspace's files."""

    @tool
    def list_studies() -> list[dict[str, Any]]:
        """Every study directory in the workspace: name, trials, trials done, whether its runner runs."""
        return workspace.list_studies()

    @tool
    def study_status(study: str) -> dict[str, Any]:
        """A study's progress: each trial's phase, episodes, reward, metric, settings now and last events."""
        return workspace.study_status(study)

    @tool
    def check_study(study_file: str) -> dict[str, Any]:
        """Validate a study file (TOML) and its agents' code dirs without running it."""
        return workspace.check_study(study_file)

    @tool
    def start_study(study_file: str, out: str) -> dict[str, Any]:
        """Run a study in the background (`agentjet-client research run STUDY_FILE --out OUT`); on an
        OUT holding a stopped study it continues it."""
        return workspace.start_study(study_file, out)

    @tool
    def stop_study(study: str) -> dict[str, Any]:
        """Stop a study's runner; every running trial writes a checkpoint first (start_study continues)."""
        return workspace.stop_study(study)

    @tool
    def read_report(study: str) -> str:
        """A study's report (markdown): leaderboard, best configuration, live changes, trials' events."""
        return workspace.read_report(study)

    @tool
    def read_file(path: str, limit: int = 20000) -> str:
        """A text file of the workspace (a log, an agent's code, a study file): its last LIMIT characters."""
        return workspace.read_file(path, limit)


def _run_tools(tool: Tool, workspace: Workspace) -> None:
    """The tools on training runs: list, status, metrics, trajectories, live settings, pause and resume."""

    @tool
    def list_runs() -> list[dict[str, Any]]:
        """Every training run (study trial) in the workspace with its server URL and phase."""
        return workspace.list_runs()

    @tool
    def run_status(run: str) -> dict[str, Any]:
        """A run's status (STUDY_DIR/tNNN or a server URL): policy version, learner step, trajectory counts."""
        return workspace.run_status(run)

    @tool
    def run_metrics(run: str, kind: str = "step", since: int = 0, limit: int = 200) -> dict[str, Any]:
        """A run's metrics history after line SINCE: kind step (loss, reward, KL, entropy per learner step),
        eval, config (settings changes) or adopt; comma-separate several."""
        return workspace.run_metrics(run, kind, since, limit)

    @tool
    def recent_trajectories(run: str, limit: int = 5) -> list[dict[str, Any]]:
        """A run's newest trajectories (at most 20): task, reward and where it came from, policy versions, and
        each timeline's text (the conversation as the model saw and wrote it)."""
        return workspace.recent_trajectories(run, limit)

    @tool
    def set_live_setting(run: str, settings: dict[str, Any]) -> dict[str, Any]:
        """Change live settings of a running run, e.g. {"lr": 0.0005}; they apply from the next learner step
        and appear in the run's metrics (kind config)."""
        return workspace.set_live_setting(run, settings)

    @tool
    def pause_run(run: str) -> dict[str, Any]:
        """Pause learning after the step in progress; serving and ingestion go on."""
        return workspace.pause_run(run)

    @tool
    def resume_run(run: str) -> dict[str, Any]:
        """Start learning again after a pause."""
        return workspace.resume_run(run)


def serve(root: Path, http: bool, host: str, port: int) -> None:
    server = build_server(Workspace(root), host, port)
    server.run("streamable-http" if http else "stdio")
