"""The agent skills (``skills/*/SKILL.md``) name only what exists: every ``agentjet-client`` and
``agentjet-server`` command they show answers ``--help`` (each option they pass is in that help),
and every MCP tool they name is one ``agentjet-client mcp`` serves."""

from __future__ import annotations

import asyncio
import re
import shlex
from pathlib import Path

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from agentjet_client.cli import app as client_app
from agentjet_client.research.mcp_server import build_server
from agentjet_client.research.tools import Workspace
from agentjet_server.cli import app as server_app

ROOT = Path(__file__).resolve().parents[2]
SKILLS = sorted((ROOT / "skills").glob("*/SKILL.md"))
COMMAND = re.compile(r"(agentjet-(?:client|server) [^`\n]*)")


def commands(text: str) -> list[str]:
    """The command lines a skill shows: in code blocks and in inline code."""
    found = []
    for line in text.splitlines():
        for match in COMMAND.finditer(line):
            command = match.group(1).split("  #")[0].split(" # ")[0].strip()
            found.append(command)
    return found


def test_there_are_skills_for_writing_agents_and_studies_monitoring_and_collapses():
    names = {path.parent.name for path in SKILLS}
    assert {"writing-a-swarm-agent", "writing-a-study", "monitoring-a-run", "diagnosing-a-collapse"} <= names


@pytest.mark.parametrize("skill", SKILLS, ids=lambda p: p.parent.name)
def test_every_command_a_skill_names_exists_with_the_options_it_passes(skill):
    text = skill.read_text()
    front = re.match(r"^---\nname: (.+)\ndescription: (.+)\n---\n", text)
    assert front and front.group(1) == skill.parent.name and len(front.group(2)) > 40, "front matter"
    lines = commands(text)
    assert lines, "a skill shows the commands it means"
    runner = CliRunner()
    for line in lines:
        words = shlex.split(line)
        app = client_app if words[0] == "agentjet-client" else server_app
        path = []
        for word in words[1:]:
            if word.startswith("-"):
                break
            path.append(word)
        result = runner.invoke(app, [*path, "--help"])
        assert result.exit_code == 0, f"{skill.parent.name}: `{line}` -> {result.output[-500:]}"
        command = get_command(app)
        for name in path:  # the command itself (arguments after it are not subcommands)
            sub = getattr(command, "commands", {}).get(name)
            if sub is None:
                break
            command = sub
        options = {"--help"} | {opt for param in command.params for opt in [*param.opts, *param.secondary_opts]}
        for option in (w.split("=")[0] for w in words if w.startswith("--")):
            assert option in options, f"{skill.parent.name}: `{line}`: {option} is not an option there"


def test_every_mcp_tool_a_skill_names_is_served(tmp_path):
    tools = {t.name for t in asyncio.run(build_server(Workspace(tmp_path)).list_tools())}
    for skill in SKILLS:
        for line in skill.read_text().splitlines():
            if "MCP" not in line:
                continue
            named = set(re.findall(r"`([a-z]+(?:_[a-z]+)+)`", line))
            assert named <= tools, f"{skill.parent.name}: {sorted(named - tools)} are not MCP tools"
