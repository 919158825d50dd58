"""A task with no checker trained with a group judge, end to end: the judged example against a real
server and the stand-in judge endpoint as its own process, killed mid-run and restarted. Checked in the
server's log: every episode arrived (0 lost) with the judge's reward, no judge call in any trajectory."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agentjet_client.protocol import Trajectory
from agentjet_server.ingest.wal import Accepted, read_records
from tests.conftest import RulesJudge, ServerProcess, reap

pytestmark = pytest.mark.e2e
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "judged"
EPISODES, GROUP = 96, 4


def test_a_group_judge_killed_mid_run_loses_nothing_and_never_enters_a_trained_timeline(model_dir, tmp_path):
    state = tmp_path / "state"
    # episodes wait for the judge while it is down and reach the server late: a staleness bound above the
    # run's length keeps them all (docs/judges.md: a judge's delay counts against --max-staleness)
    # no checkpoint until the end: a checkpoint compacts the log the test reads the trained trajectories from
    args = ["--batch-groups", "1", "--group-size", str(GROUP), "--max-staleness", "64", "--checkpoint-every", "0"]
    args += ["--state-dir", str(state)]
    server = ServerProcess(args, tmp_path / "s.log")
    judge = RulesJudge("digits")
    run = None
    try:
        exe = str(Path(sys.executable).parent / "agentjet-client")
        command = [exe, "run", "--code-dir", str(EXAMPLE), "--server", server.url, "--episodes", str(EPISODES)]
        env = {**os.environ, "AGENTJET_DIGITS": "3,8", "AGENTJET_JUDGE_URL": judge.url}
        run = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 120
        while server.status()["trajectories"]["accepted"] < 4 * GROUP:  # some groups judged and delivered
            assert run.poll() is None and time.monotonic() < deadline, run.stdout.read() if run.stdout else ""
            time.sleep(0.1)
        judged_before = judge.calls()
        judge.stop()  # down: the episodes that finish meanwhile wait in the spool
        time.sleep(3)
        held = server.status()["trajectories"]["accepted"]
        judge = RulesJudge("digits", port=judge.port)
        out, _ = run.communicate(timeout=300)
        assert run.returncode == 0, out
        judged_after = judge.calls()
        status = server.wait_trained()
        records = list(read_records(state / "log"))
        history = [json.loads(line) for line in (state / "metrics.jsonl").read_text().splitlines()]
    finally:
        reap(run)
        judge.stop()
        server.stop()
    summary = " ".join(out.split())
    trajectories = [Trajectory.model_validate(r.trajectory) for r in records if isinstance(r, Accepted)]
    counts = status["trajectories"]
    assert counts["accepted"] == EPISODES and counts["rejected"] == 0 and len(trajectories) == EPISODES  # 0 lost
    # while the judge was down nothing unjudged went out: all that arrived the first judge had judged
    assert held <= judged_before * GROUP + GROUP, (held, judged_before)
    # the cost line: every call the two judges answered, none of them counted twice with the kept answers
    cost = re.search(
        r"judge: (\d+) calls answered \((\d+) without usable scores\), (\d+) unanswered, \d+ prompt \+ \d+ "
        r"completion tokens, [\d.]+s; besides them, (\d+) groups judged from the answers kept in the spool \(no call\)",
        summary,
    )
    assert cost is not None, summary
    assert int(cost.group(1)) == judged_before + judged_after and int(cost.group(2)) == 0, (cost.group(0), judged_after)
    for trajectory in trajectories:
        meta = trajectory.metadata
        assert "agentjet_waiting_for" not in meta and meta["judge"]["kind"] == "group"
        assert trajectory.reward == meta["reward_components"]["judge"] in (0.0, 0.2, 1.0)
        # only the agent's own call: the judge's prompt is in no turn, so in no timeline the learner trains
        assert len(trajectory.turns) == 1
        assert trajectory.turns[0].request_messages[0]["content"].startswith("Write ")
        assert all("candidate" not in str(m).lower() for t in trajectory.turns for m in t.request_messages)
    groups = {t.task_id for t in trajectories}
    assert len(groups) == EPISODES // GROUP
    # per task on the server: every group counted, and the judge's component plotted per step
    rates = {t["task"]: t for t in status["tasks"]}
    assert set(rates) == {"word-3", "word-8"} and sum(t["groups"] for t in rates.values()) == EPISODES // GROUP
    assert sum(t["episodes"] for t in rates.values()) == EPISODES
    steps = [line for line in history if line["kind"] == "step"]
    assert steps and all(set(line["reward_components"]) == {"judge"} for line in steps)
    print(f"judged run: {EPISODES} accepted, judge calls {judged_before} before the kill; {summary[-300:]}")
