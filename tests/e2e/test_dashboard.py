"""The dashboard in a real headless Chromium (Debian's ``chromium``, driven by playwright): a server
that trained from a short client run shows its reward curve (the points of metrics.jsonl, exactly),
the tokens of a real trajectory with the trained ones marked, and asks for the key when keys are set.
Screenshots go to ``.agentjet/screenshots/`` (or ``$AGENTJET_SCREENSHOTS``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx2
import pytest

from agentjet_server.ingest.wal import Accepted, Evaluated, read_records
from tests.conftest import LiveServer, ServerProcess, run_digits_client

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SHOTS = Path(os.environ.get("AGENTJET_SCREENSHOTS", ROOT / ".agentjet" / "screenshots"))

playwright = pytest.importorskip("playwright.sync_api", reason="the dashboard test drives Chromium with playwright")
if CHROMIUM is None:
    pytest.skip("no chromium on PATH (python3 scripts/dev.py test installs Debian's package)", allow_module_level=True)


RUBRIC_AGENT = """
from agentjet_client import Rubric, swarm_agent


def is_digit(result):
    return 1.0 if result.strip().isdigit() else 0.0


def short(result):
    return 0.5


@swarm_agent(tasks=[{"id": "rubric"}], reward=Rubric([is_digit, short]))
def reply(task, episode):
    answer = episode.openai().chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Write three as a digit."}], max_tokens=3
    )
    return answer.choices[0].message.content or ""
"""


@pytest.fixture
def browser():  # type: ignore[no-untyped-def]
    with playwright.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        yield chromium
        chromium.close()


def open_page(browser, url: str):  # type: ignore[no-untyped-def]
    page = browser.new_page(viewport={"width": 1400, "height": 1800})
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url)
    return page, errors


def test_the_dashboard_shows_a_trained_run_its_reward_curve_and_a_trajectory_token_by_token(browser, tmp_path):
    state = tmp_path / "state"
    args = ["--batch-groups", "1", "--group-size", "8", "--state-dir", str(state), "--metrics-interval", "1"]
    server = ServerProcess(args, tmp_path / "s.log", env={"AGENTJET_DIGITS": "3,8"})
    try:
        # a batch whose group has one reward throughout carries no signal and is skipped, so how many
        # of 12 groups make a step depends on the samples: rounds (new seeds) until the curve has 3
        for round_ in range(4):
            extra = ("--eval-every", "4", "--eval-episodes", "8", "--seed", str(round_))
            run_digits_client(server.url, 96, 8, *extra)
            status = server.wait_trained()  # the learner takes the last batches after the client is done
            if status["learner"]["step"] >= 3:
                break
        assert status["learner"]["step"] >= 3, status["learner"]

        def expected_points() -> list[tuple[int, float]]:
            history = [json.loads(x) for x in (state / "metrics.jsonl").read_text().splitlines()]
            return [(x["policy_version"], x["mean_reward"]) for x in history if x["kind"] == "step"]

        deadline = time.monotonic() + 30
        while len(expected := expected_points()) < status["learner"]["step"] and time.monotonic() < deadline:
            time.sleep(0.1)  # a step's history line is written just after it is counted
        assert len(expected) == status["learner"]["step"]
        page, errors = open_page(browser, server.url + "/")  # / leads to the dashboard
        assert page.url.endswith("/dashboard")
        train = 'svg[data-chart="chart-reward"] circle[data-series="train: all tags"]'
        page.wait_for_function(f"document.querySelectorAll('{train}').length === {len(expected)}", timeout=30_000)
        SHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SHOTS / "dashboard.png"), full_page=True)

        drawn = page.eval_on_selector_all(train, "cs => cs.map(c => [Number(c.dataset.x), Number(c.dataset.y)])")
        assert [tuple(p) for p in drawn] == expected  # every point of the run, exactly
        evals = page.eval_on_selector_all(
            'svg[data-chart="chart-reward"] circle[data-series^="eval: "]', "cs => cs.length"
        )
        assert evals >= 2  # evaluation rounds at two policy versions at least
        # rewards on an axis from 0 to 1 at least (chance must not look like swings), round ticks, and
        # a rolling mean over the raw points
        ticks = page.eval_on_selector_all(
            'svg[data-chart="chart-reward"] text[data-tick="y"]', "ts => ts.map(t => t.textContent)"
        )
        assert ticks[0] == "0" and float(ticks[-1]) >= 1 and all(len(t) <= 4 for t in ticks), ticks
        assert not [t for t in ticks if t.startswith("-0")], ticks
        mean = page.eval_on_selector_all(
            'svg[data-chart="chart-reward"] circle[data-series="train: all tags (mean of 10)"]',
            "cs => cs.map(c => Number(c.dataset.y))",
        )
        rewards = [y for _, y in expected]
        assert mean == pytest.approx(
            [sum(rewards[max(0, i - 9) : i + 1]) / len(rewards[max(0, i - 9) : i + 1]) for i in range(len(rewards))]
        )
        # the sampler against the trainer: each step's median token ratio, as its history line has it
        history = [json.loads(x) for x in (state / "metrics.jsonl").read_text().splitlines()]
        medians = [x["mismatch_token_p50"] for x in history if x["kind"] == "step"]
        ratio = 'svg[data-chart="chart-mismatch"] circle[data-series="token ratio p50"]'
        assert page.eval_on_selector_all(ratio, "cs => cs.map(c => Number(c.dataset.y))") == pytest.approx(medians)
        page.locator("#chart-mismatch").screenshot(path=str(SHOTS / "dashboard-mismatch.png"))
        assert page.inner_text("#version") == f"policy v{server.status()['policy_version']}"
        # the task table: each task's accepted training episodes, as /v1/status counts them
        rates = {t["task"]: t for t in server.status()["tasks"]}
        assert set(rates) == {"digit-3", "digit-8"} and sum(t["groups"] for t in rates.values()) >= 12
        shown = page.eval_on_selector_all(
            "#tasks tr", "rs => rs.slice(1).map(r => [...r.cells].map(c => c.textContent))"
        )
        assert {row[0]: int(row[1]) for row in shown} == {task: t["episodes"] for task, t in rates.items()}

        # the trajectory browser: filtered by reward and sorted by a column
        listed = httpx2.get(server.url + "/v1/trajectories?limit=200").json()["trajectories"]
        page.select_option("#filter-reward", "pos")
        rows = page.eval_on_selector_all("#trajectory-list tbody tr", "rs => rs.map(r => Number(r.dataset.reward))")
        assert rows and all(r > 0 for r in rows) and len(rows) == sum(t["reward"] > 0 for t in listed), rows
        page.select_option("#filter-reward", "")
        page.click('#trajectory-list th[data-sort="reward"]')  # highest first, then lowest first
        rows = page.eval_on_selector_all("#trajectory-list tbody tr", "rs => rs.map(r => Number(r.dataset.reward))")
        assert rows == sorted(rows, reverse=True) and len(rows) == len(listed)
        page.click('#trajectory-list th[data-sort="reward"]')
        rows = page.eval_on_selector_all("#trajectory-list tbody tr", "rs => rs.map(r => Number(r.dataset.reward))")
        assert rows == sorted(rows)
        page.fill("#filter-text", "digit-3")
        tasks = page.eval_on_selector_all(
            "#trajectory-list tbody tr td:nth-child(2)", "ts => ts.map(t => t.textContent)"
        )
        assert tasks and all("digit-3" in t and "digit-8" not in t for t in tasks), tasks
        page.fill("#filter-text", "")
        page.click('#trajectory-list th[data-sort="received"]')

        # the trajectory browser: the newest trajectory, token by token
        newest = httpx2.get(server.url + "/v1/trajectories?limit=1").json()["trajectories"][0]
        page.click(f'#trajectory-list tr[data-id="{newest["id"]}"]')
        page.wait_for_selector('.tokens span[data-trained="1"]', timeout=30_000)
        trained = page.eval_on_selector_all(
            '.tokens span[data-trained="1"]', "s => s.map(x => Number(x.dataset.token))"
        )
        context = page.eval_on_selector_all(
            '.tokens span[data-trained="0"]', "s => s.map(x => Number(x.dataset.token))"
        )
        logged = {
            r.id: r.trajectory
            for r in read_records(state / "log", recent=True)
            if isinstance(r, Accepted | Evaluated) and r.trajectory is not None
        }
        [turn] = logged[newest["id"]]["turns"]  # the digits agent makes one call
        assert trained == turn["completion_token_ids"] and context == turn["prompt_token_ids"]
        assert "verified" in page.inner_text("#trajectory-view")  # the signature verdict of its call
        page.hover('.tokens span[data-trained="1"]')
        page.screenshot(path=str(SHOTS / "dashboard-trajectory.png"), full_page=True)

        # an episode rewarded by a Rubric (tried and pushed as an evaluation episode): each component's score
        code = tmp_path / "rubric"
        code.mkdir()
        (code / "agent.py").write_text(RUBRIC_AGENT)
        exe = str(Path(sys.executable).parent / "agentjet-client")
        command = [exe, "try", "--code-dir", str(code), "--server", server.url, "--push"]
        pushed = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert pushed.returncode == 0 and "pushed as an evaluation episode: accepted" in pushed.stdout, pushed.stdout
        tried = httpx2.get(server.url + "/v1/trajectories?limit=1").json()["trajectories"][0]
        assert tried["task_id"] == "try:rubric"
        page.reload()
        page.click(f'#trajectory-list tr[data-id="{tried["id"]}"]')
        page.wait_for_selector("#reward-detail", timeout=30_000)
        page.screenshot(path=str(SHOTS / "dashboard-reward-detail.png"), full_page=True)
        detail = page.inner_text("#reward-detail")
        assert detail in ("reward components: is_digit 1, short 0.5", "reward components: is_digit 0, short 0.5"), (
            detail
        )
        assert not errors, errors
    finally:
        server.stop()


def test_with_keys_the_dashboard_asks_for_one_and_then_shows_the_run(browser, model_dir):
    server = LiveServer(model_dir, api_keys=["client-key-123"], admin_keys=["admin-key-456"])
    try:
        page, errors = open_page(browser, server.url + "/dashboard")
        page.wait_for_selector("#keyform", state="visible", timeout=30_000)
        page.fill("#key", "client-key-123")
        page.click("#keyform button")
        page.wait_for_function("document.querySelector('#model').textContent === 'agentjet-tiny'", timeout=30_000)
        page.click("#pause-button")  # a client key may look, not steer
        page.wait_for_function("document.querySelector('#message').textContent.includes('admin key')", timeout=30_000)
        SHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SHOTS / "dashboard-keyed.png"), full_page=True)
        assert not server.runtime.loop.paused
        assert [e for e in errors if "401" not in e and "403" not in e] == []  # the refusals themselves are expected
    finally:
        server.stop()


def test_the_loss_chart_draws_each_mode_apart(browser, model_dir):
    """Steps of RL, supervised fine-tuning and DPO on one server: the loss chart draws each mode's loss as a
    series of its own (each step once), and DPO's reward margin beside them."""
    from tests.server.learner.test_preference import digit_pairs
    from tests.server.learner.test_supervised import digit_chats

    server = LiveServer(model_dir, batch_groups=1, group_size=8)
    try:
        for _ in range(3):
            httpx2.post(server.url + "/v1/train/sft", json={"examples": digit_chats()}, timeout=120).raise_for_status()
        scored = httpx2.post(server.url + "/v1/train/dpo", json={"pairs": digit_pairs(), "evaluate": True}).json()
        pairs = [
            {**p, "ref_chosen_logps": c, "ref_rejected_logps": r}
            for p, c, r in zip(digit_pairs(), scored["chosen_logps"], scored["rejected_logps"], strict=True)
        ]
        for _ in range(4):
            httpx2.post(
                server.url + "/v1/train/dpo", json={"pairs": pairs, "beta": 0.5}, timeout=120
            ).raise_for_status()
        for round_ in range(4):  # groups whose rewards are all equal make no step: rounds until two RL steps
            run_digits_client(server.url, 48, 8, "--seed", str(round_))
            if httpx2.get(server.url + "/v1/status").json()["learner"]["step"] >= 9:
                break
        lines = httpx2.get(server.url + "/v1/metrics/history").json()
        steps = [line for line in (lines["lines"] if isinstance(lines, dict) else lines) if line.get("kind") == "step"]
        counts = {mode: sum(s["mode"] == mode for s in steps) for mode in ("rl", "sft", "dpo")}
        assert counts["sft"] == 3 and counts["dpo"] == 4 and counts["rl"] >= 2, counts
        page, errors = open_page(browser, server.url + "/dashboard")
        chart = 'svg[data-chart="chart-loss"] circle[data-series="{}"]'
        series = {
            "loss (RL)": counts["rl"],
            "loss (SFT: NLL per token)": 3,
            "loss (DPO)": 4,
            "DPO reward margin": 4,
        }
        for name, count in series.items():
            selector = chart.format(name)
            page.wait_for_function(f"document.querySelectorAll('{selector}').length === {count}", timeout=30_000)
        SHOTS.mkdir(parents=True, exist_ok=True)
        page.locator("#chart-loss").screenshot(path=str(SHOTS / "dashboard-loss-modes.png"))
        drawn = page.eval_on_selector_all(chart.format("loss (DPO)"), "cs => cs.map(c => Number(c.dataset.y))")
        assert drawn == pytest.approx([s["loss"] for s in steps if s["mode"] == "dpo"], rel=1e-6)
        assert not errors, errors
    finally:
        server.stop()
