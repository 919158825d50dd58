"""End to end: a coding agent's view of AgentJet. The ``mcp`` package's own client starts
``agentjet-client mcp`` over stdio, lists its tools, starts a study on the demo, reads a trial's
status, metrics and trajectories, changes a live setting of the trial (the change is in that trial's
metrics.jsonl), pauses and resumes it, stops the study; the same tools answer over streamable HTTP.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client

from tests.conftest import CACHE

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e

TOOLS = {
    "list_studies",
    "study_status",
    "check_study",
    "start_study",
    "stop_study",
    "read_report",
    "read_file",
    "list_runs",
    "run_status",
    "run_metrics",
    "recent_trajectories",
    "set_live_setting",
    "pause_run",
    "resume_run",
}


def workspace(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    shutil.copytree(ROOT / "examples" / "digits", work / "digits", ignore=shutil.ignore_patterns("__pycache__"))
    (work / "study.toml").write_text(
        """
[study]
name = "mcp study"
poll_seconds = 0.5
metric = "train_reward"

[trial]
episodes = 500000
minutes = 4

[server]
batch_groups = 4
checkpoint_every = 5

[client]
code_dir = "digits"
concurrency = 16
env = { AGENTJET_DIGITS = "3,8" }

[space]
"server.lr" = [1e-3]
"""
    )
    return work


async def call(session: ClientSession, name: str, **arguments: Any) -> Any:
    result = await session.call_tool(name, arguments)
    text = "".join(getattr(c, "text", "") for c in result.content)
    if result.isError:
        raise RuntimeError(text)
    if result.structuredContent is not None:
        content = result.structuredContent
        return content.get("result", content) if set(content) == {"result"} else content
    return json.loads(text) if text[:1] in "[{" else text


async def until(what: str, check: Any, limit: float = 240.0) -> Any:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        value = await check()
        if value:
            return value
        await asyncio.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_coding_agent_runs_and_steers_a_study_through_the_mcp_server(tmp_path):
    work = workspace(tmp_path)
    env = {**os.environ, "AGENTJET_CACHE_DIR": str(CACHE)}
    params = StdioServerParameters(
        command=sys.executable, args=["-m", "agentjet_client", "mcp", "--root", str(work)], env=env
    )
    metrics = work / "out" / "trials" / "t000" / "state" / "metrics.jsonl"

    async def agent() -> None:
        async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            tools = {t.name for t in (await session.list_tools()).tools}
            assert tools == TOOLS, tools
            assert (await call(session, "check_study", study_file="study.toml"))["trials"] == 1
            started = await call(session, "start_study", study_file="study.toml", out="out")
            assert started["study"] == "out" and started["pid"] > 0

            async def training() -> bool:
                status = await call(session, "study_status", study="out")
                trial = status["trials"][0]
                return trial["phase"] == "training" and trial["episodes"] > 0

            await until("the trial to train", training)
            runs = await call(session, "list_runs")
            assert [r["run"] for r in runs] == ["out/t000"] and runs[0]["url"].startswith("http://127.0.0.1:")
            status = await call(session, "run_status", run="out/t000")
            assert status["trajectories"]["accepted"] > 0

            changed = await call(session, "set_live_setting", run="out/t000", settings={"lr": 0.00077})
            assert changed["changes"][-1]["changes"] == {"lr": 0.00077} and "lr" in changed["live"]
            lines = [json.loads(x) for x in metrics.read_text().splitlines()]
            assert any(x["kind"] == "config" and x["changes"] == {"lr": 0.00077} for x in lines)  # the trial's file
            history = await call(session, "run_metrics", run="out/t000", kind="config")
            assert history["lines"][-1]["changes"] == {"lr": 0.00077}

            async def stepped() -> Any:
                return (await call(session, "run_metrics", run="out/t000", kind="step"))["lines"]

            assert (await until("a learner step", stepped))[-1]["loss"] is not None
            trajectories = await call(session, "recent_trajectories", run="out/t000", limit=3)
            assert 1 <= len(trajectories) <= 3 and isinstance(trajectories[0]["reward"], float)
            said = trajectories[0]["timelines"][0]["text"]  # the conversation: the digits agent's question, answered
            assert "as a digit." in said and "<|im_start|>assistant" in said, trajectories[0]
            assert (await call(session, "pause_run", run="out/t000"))["paused"] is True
            assert (await call(session, "resume_run", run="out/t000"))["paused"] is False

            with pytest.raises(RuntimeError, match="outside the workspace"):
                await call(session, "study_status", study="../..")
            with pytest.raises(RuntimeError, match="not a study directory"):
                await call(session, "read_report", study="digits")
            with pytest.raises(RuntimeError, match="no trial t009"):
                await call(session, "run_status", run="out/t009")

            assert "pid" in (await call(session, "stop_study", study="out"))["message"]

            async def stopped() -> bool:
                return (await call(session, "study_status", study="out"))["runner"] == "not running"

            await until("the runner to stop", stopped, limit=200)
            studies = await call(session, "list_studies")
            assert studies == [{"study": "out", "name": "mcp study", "trials": 1, "done": 0, "runner": "not running"}]
            assert "| t000 |" in await call(session, "read_report", study="out")

    asyncio.run(agent())
    trial = json.loads((work / "out" / "trials" / "t000" / "trial.json").read_text())
    assert trial["phase"] == "interrupted" and trial["server_pid"] is None, trial  # stopped with a checkpoint
    assert any((work / "out" / "trials" / "t000" / "state" / "checkpoints").glob("step-*"))


def test_the_same_tools_answer_over_streamable_http(tmp_path):
    work = workspace(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "agentjet_client", "mcp", "--root", str(work), "--http", "--port", str(port)]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    async def agent() -> None:
        deadline = time.monotonic() + 60
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                assert time.monotonic() < deadline and server.poll() is None, "the MCP server did not start"
                await asyncio.sleep(0.2)
        async with (
            streamable_http_client(f"http://127.0.0.1:{port}/mcp") as (read, write, _),
            ClientSession(read, write) as session,
        ):
            await session.initialize()
            assert {t.name for t in (await session.list_tools()).tools} == TOOLS
            assert await call(session, "list_studies") == []
            assert "agentjet-tiny" in await call(session, "read_file", path="digits/agent.py")

    try:
        asyncio.run(agent())
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_the_http_server_refuses_an_address_other_machines_reach_unless_asked(tmp_path):
    from typer.testing import CliRunner

    from agentjet_client.cli import app

    result = CliRunner().invoke(app, ["mcp", "--root", str(tmp_path), "--http", "--host", "0.0.0.0"])
    assert result.exit_code == 2 and "no authentication" in " ".join(result.output.split())
    result = CliRunner().invoke(app, ["mcp", "--root", str(tmp_path / "missing")])
    assert result.exit_code == 2 and "is not a directory" in " ".join(result.output.split())
