"""``agentjet-client research auto``: a research loop driven by an LLM.

Each round: the researcher (``researcher.py``) reads the topic, the agent's code and the earlier
rounds' reports and answers with a plan (hypotheses, agent-code variants, a study file); the plan is
written under ``OUT/rounds/rNN/`` and checked (``variants.py``: every variant plays one episode in its
own interpreter, the study validates, nothing reaches outside OUT); a failed check goes back to the
researcher with the errors, and a round whose plan fails ``MAX_ATTEMPTS`` times is abandoned; the
study runs through the same tools a coding agent uses over MCP (``tools.Workspace``); the researcher
judges each hypothesis from the study's report and decides whether to go on. ``findings.py`` writes
``OUT/findings.md`` after every round.

Budgets (rounds, trials, CPU and GPU hours of trials, wall time, LLM tokens) are checked before each
step; a study that runs past one is stopped (its trials checkpoint) and judged as it stands.

Everything is on disk: ``OUT/auto.json`` (the loop's state, rewritten at every step, with each round's
conversation), ``OUT/log.jsonl`` (every prompt, answer, check and decision). Killed and started again
with the same ``--out``, the loop continues where it was: a running study's runner is continued (its
finished trials are kept), an answer already received is not asked for again.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from agentjet_client.errors import StudyError
from agentjet_client.research import prompts
from agentjet_client.research.researcher import Researcher, json_answer
from agentjet_client.research.tools import ToolError, Workspace
from agentjet_client.research.trial import write_atomic
from agentjet_client.research.variants import check_round, write_round

MAX_ATTEMPTS = 3  # plans per round before it is abandoned
FORMAT_RETRIES = 2  # verdict answers that are not the JSON asked for, before the verdicts are called inconclusive
VERDICTS = ("confirmed", "refuted", "inconclusive")


@dataclass(frozen=True)
class Budgets:
    rounds: int = 3
    trials: int | None = None
    cpu_hours: float | None = None
    gpu_hours: float | None = None
    hours: float | None = None
    tokens: int | None = None


class Round(BaseModel):
    number: int
    phase: Literal["planning", "running", "judging", "done", "abandoned"] = "planning"
    messages: list[dict[str, str]] = Field(default_factory=list)  # this round's conversation
    attempts: int = 0  # plans received
    plan: dict[str, Any] | None = None
    problems: list[list[str]] = Field(default_factory=list)  # each plan's failed checks
    checked: dict[str, Any] | None = None  # what the study plans (``research check``)
    study: str | None = None  # its --out, relative to OUT
    budget_stop: str | None = None
    verdicts: list[dict[str, Any]] = Field(default_factory=list)
    decision: str | None = None
    reason: str | None = None
    next: str | None = None

    @property
    def folder(self) -> str:
        return f"rounds/r{self.number:02d}"


class AutoState(BaseModel):
    topic: str
    code_dir: str
    researcher: dict[str, str]
    rounds: list[Round] = Field(default_factory=list)
    usage: dict[str, int] = Field(default_factory=lambda: {"prompt": 0, "completion": 0, "calls": 0})
    active_s: float = 0.0
    finished: str | None = None  # why the loop ended

    def tokens(self) -> int:
        return self.usage["prompt"] + self.usage["completion"]


class AutoResearch:
    def __init__(
        self,
        topic: str,
        code_dir: Path,
        out: Path,
        researcher: Researcher,
        budgets: Budgets,
        check_server: str | None = None,
        say: Callable[[str], None] = print,
        poll_s: float = 2.0,
    ) -> None:
        self.out = out.resolve()
        self.code_dir = code_dir.resolve()
        self.topic = topic
        self.researcher = researcher
        self.budgets = budgets
        self.say = say
        self.poll_s = poll_s
        self.workspace = Workspace(self.out)
        self._check_url = check_server
        self._check_process: subprocess.Popen[bytes] | None = None
        self._started = time.monotonic()
        self.state = self._open()

    # -- the loop ---------------------------------------------------------------------------------
    def run(self) -> AutoState:
        from agentjet_client.research.findings import write_findings

        try:
            while self.state.finished is None:
                current = self._current()
                if current is None:
                    break
                try:
                    self._advance(current)
                except KeyboardInterrupt:
                    if current.phase == "running" and current.study is not None:
                        self.say(f"interrupted: stopping round {current.number}'s study (its trials checkpoint)")
                        try:
                            self.workspace.stop_study(current.study)
                        except ToolError:
                            pass
                    self.say("run the same command to continue")
                    raise
                self._save()
                write_findings(self.out, self.state)
        finally:
            self._stop_check_server()
            self._save()
            write_findings(self.out, self.state)
        self.say(f"done: {self.state.finished}; findings in {self.out / 'findings.md'}")
        return self.state

    def _current(self) -> Round | None:
        """The round in progress, or a new one; None (and ``finished`` set) when the loop ends."""
        state = self.state
        if state.rounds and state.rounds[-1].phase not in ("done", "abandoned"):
            return state.rounds[-1]
        last = state.rounds[-1] if state.rounds else None
        if last is not None and last.decision == "stop":
            return self._finish(f"the researcher stopped after round {last.number}: {last.reason or ''}".strip())
        if len(state.rounds) >= self.budgets.rounds:
            return self._finish(f"the round budget ({self.budgets.rounds}) is used")
        spent = self._spent()
        if spent:
            return self._finish(spent)
        if self._trials_left() == 0:
            return self._finish(f"the trial budget ({self.budgets.trials}) is used")
        round_ = Round(number=len(state.rounds) + 1)
        state.rounds.append(round_)
        self._log("round", round_, message="started")
        return round_

    def _advance(self, round_: Round) -> None:
        if round_.phase == "planning":
            self._plan(round_)
        elif round_.phase == "running":
            self._run_study(round_)
        elif round_.phase == "judging":
            self._judge(round_)

    def _finish(self, why: str) -> Round | None:
        """End the loop (``why`` says why); None, for ``_current``."""
        self.state.finished = why
        return None

    # -- planning ---------------------------------------------------------------------------------
    def _plan(self, round_: Round) -> None:
        answers = sum(m["role"] == "assistant" for m in round_.messages)  # every one of them a plan
        if answers == round_.attempts:  # each answer so far was checked: ask for the next
            if round_.attempts == 0:
                prompt = prompts.plan_prompt(
                    round_.number, self.topic, prompts.code_listing(self.code_dir), self._earlier(), self._budget_text()
                )
            else:
                prompt = prompts.repair_prompt(round_.number, round_.attempts, round_.problems[-1])
            self.say(
                f"round {round_.number}: asking the researcher for a plan"
                + (f" (repair {round_.attempts}/{MAX_ATTEMPTS - 1})" if round_.attempts else "")
            )
            if self._ask(round_, prompt) is None:
                return
        answer = round_.messages[-1]["content"]
        round_.attempts += 1
        folder = self.out / round_.folder
        folder.mkdir(parents=True, exist_ok=True)
        try:
            plan = json_answer(answer)
        except ValueError as exc:
            problems = [f"the answer is not the JSON plan asked for: {exc}"]
        else:
            round_.plan = plan
            problems = write_round(folder, self.code_dir, plan) or self._check(round_, folder)
        self._log("check", round_, attempt=round_.attempts, problems=problems)
        if not problems:
            self._stop_check_server()  # the study needs the machine; the next round starts another
            round_.phase = "running"
            round_.study = f"{round_.folder}/study"
            trials = (round_.checked or {}).get("trials")
            self.say(f"round {round_.number}: the plan passed its checks ({trials} trials)")
            return
        round_.problems.append(problems)
        self.say(f"round {round_.number}: the plan failed its checks: {'; '.join(problems)[:600]}")
        if round_.attempts >= MAX_ATTEMPTS:
            self._stop_check_server()
            round_.phase = "abandoned"
            round_.reason = f"its plan failed its checks {MAX_ATTEMPTS} times"
            self.say(f"round {round_.number}: abandoned ({round_.reason})")
            self._log("decision", round_, decision="abandoned", problems=problems)

    def _check(self, round_: Round, folder: Path) -> list[str]:
        try:
            server = self._check_server()
        except StudyError as exc:
            raise StudyError(f"cannot check plans: {exc}") from exc
        self.say(f"round {round_.number}: checking the plan (each variant plays one episode in its own interpreter)")
        problems, checked = check_round(folder, self.out, self.workspace, server, self._trials_left())
        round_.checked = checked
        return problems

    # -- the study --------------------------------------------------------------------------------
    def _run_study(self, round_: Round) -> None:
        assert round_.study is not None
        study_file = f"{round_.folder}/study.toml"
        status = self._status(round_)
        if status is None or status["runner"] == "not running":
            spent = self._spent()
            if spent and status is not None:  # stopped for the budget: judged as it stands
                round_.budget_stop = spent
                round_.phase = "judging"
                return
            self.say(f"round {round_.number}: {'starting' if status is None else 'continuing'} its study")
            try:
                self.workspace.start_study(study_file, round_.study)
            except ToolError as exc:
                now = self._status(round_)
                if now is not None and now["runner"] != "not running":
                    return  # a runner of its own took it meanwhile: followed from the next step
                round_.phase = "abandoned"
                round_.reason = f"its study would not start: {exc}"
                self._log("decision", round_, decision="abandoned", problems=[str(exc)])
                return
            self._log("study", round_, message="started")
        last = ""
        while True:
            status = self._status(round_)
            if status is None:
                time.sleep(self.poll_s)
                continue
            done = sum(t["phase"] == "done" for t in status["trials"])
            line = f"round {round_.number}: study {done}/{len(status['trials'])} trials done"
            if line != last:
                self.say(line)
                last = line
            if status["runner"] == "finished":
                round_.phase = "judging"
                return
            if status["runner"] == "not running":
                return  # the runner died: the next step continues it
            spent = self._spent()
            if spent and round_.budget_stop is None:
                round_.budget_stop = spent
                self.say(f"round {round_.number}: {spent}: stopping its study (its trials checkpoint)")
                try:
                    self.workspace.stop_study(round_.study)
                except ToolError:
                    pass
                self._save()
            time.sleep(self.poll_s)

    def _status(self, round_: Round) -> dict[str, Any] | None:
        assert round_.study is not None
        try:
            return self.workspace.study_status(round_.study)
        except ToolError:
            return None

    # -- verdicts ---------------------------------------------------------------------------------
    def _judge(self, round_: Round) -> None:
        assert round_.study is not None and round_.plan is not None
        hypotheses = [h for h in round_.plan.get("hypotheses", []) if isinstance(h, dict)]
        ids = [str(h.get("id")) for h in hypotheses]
        problem: str | None = None
        answer = ""
        header = f"[research auto] round {round_.number}: verdicts"
        kept = round_.messages[-2:] if len(round_.messages) >= 2 else []
        if kept and kept[0]["content"].startswith(header) and kept[1]["role"] == "assistant":
            answer = kept[1]["content"]  # answered before the loop was killed: not asked again
            problem = _verdict_problem(answer, ids)
        for retry in range(FORMAT_RETRIES + 1):
            if answer and problem is None:
                break
            report = self.workspace.read_report(round_.study)
            status = self.workspace.study_status(round_.study)
            prompt = prompts.verdict_prompt(round_.number, hypotheses, report, status)
            if retry:
                prompt += f"\n\nYour last answer could not be used: {problem}. Answer again."
            self.say(f"round {round_.number}: asking the researcher for verdicts")
            asked = self._ask(round_, prompt)
            if asked is None:
                return
            answer = asked
            problem = _verdict_problem(answer, ids)
            if problem is None:
                break
        verdict = json_answer(answer) if problem is None else {}
        given = {str(v.get("id")): v for v in verdict.get("verdicts", []) if isinstance(v, dict)}
        round_.verdicts = [
            given.get(i)
            or {"id": i, "verdict": "inconclusive", "evidence": f"the researcher gave no usable verdict ({problem})"}
            for i in ids
        ]
        round_.decision = "stop" if verdict.get("decision") == "stop" else "continue"
        round_.reason = str(verdict.get("reason", "")) or None
        round_.next = str(verdict.get("next", "")) or None
        round_.phase = "done"
        summary = ", ".join(f"{v['id']} {v['verdict']}" for v in round_.verdicts)
        self.say(f"round {round_.number}: {summary}; the researcher says {round_.decision}")
        self._log("decision", round_, verdicts=round_.verdicts, decision=round_.decision, reason=round_.reason)

    # -- the researcher ---------------------------------------------------------------------------
    def _ask(self, round_: Round, prompt: str) -> str | None:
        """The researcher's answer (also in the round's conversation); None when the token budget
        is spent (the loop then finishes)."""
        left = None if self.budgets.tokens is None else self.budgets.tokens - self.state.tokens()
        if left is not None and left <= 0:
            self._finish(f"the token budget ({self.budgets.tokens:,}) is used")
            return None
        round_.messages.append({"role": "user", "content": prompt})
        self._log("ask", round_, prompt=prompt)
        before = self.researcher.usage.as_dict()
        answer = self.researcher.ask(prompts.SYSTEM, round_.messages, max_tokens=min(16000, left or 16000))
        after = self.researcher.usage.as_dict()
        for key in ("prompt", "completion", "calls"):
            self.state.usage[key] += after[key] - before[key]
        round_.messages.append({"role": "assistant", "content": answer})
        self._log("answer", round_, answer=answer, usage={k: after[k] - before[k] for k in after})
        self._save()
        return answer

    # -- budgets ----------------------------------------------------------------------------------
    def _spent(self) -> str | None:
        """Which budget (other than rounds and trials) is used up, if one is."""
        b, state = self.budgets, self.state
        if b.tokens is not None and state.tokens() >= b.tokens:
            return f"the token budget ({b.tokens:,}) is used"
        if b.hours is not None and self._seconds() >= b.hours * 3600:
            return f"the wall-time budget ({b.hours:g} h) is used"
        cpu, gpu = self._trial_hours()
        if b.cpu_hours is not None and cpu >= b.cpu_hours:
            return f"the CPU budget ({b.cpu_hours:g} core-hours) is used"
        if b.gpu_hours is not None and gpu >= b.gpu_hours:
            return f"the GPU budget ({b.gpu_hours:g} GPU-hours) is used"
        return None

    def _trial_hours(self) -> tuple[float, float]:
        """Core-hours and GPU-hours the rounds' trials ran (a trial on a listed device counts one GPU)."""
        cpu = gpu = 0.0
        for round_ in self.state.rounds:
            if round_.study is None or round_.checked is None:
                continue
            for path in (self.out / round_.study / "trials").glob("t*/trial.json"):
                record = json.loads(path.read_text())
                seconds = record.get("active_s", 0.0)
                if record.get("run_started_at"):
                    seconds += time.time() - record["run_started_at"]
                if round_.checked.get("devices"):
                    gpu += seconds / 3600
                else:
                    cpu += seconds * int(round_.checked.get("cores_per_trial", 1)) / 3600
        return cpu, gpu

    def _trials_left(self) -> int | None:
        if self.budgets.trials is None:
            return None
        ran = ("running", "judging", "done")  # an abandoned plan's trials never ran
        used = sum(int((r.checked or {}).get("trials", 0)) for r in self.state.rounds if r.phase in ran)
        return max(0, self.budgets.trials - used)

    def _budget_text(self) -> str:
        b = self.budgets
        parts = [f"{b.rounds - len(self.state.rounds) + 1} round(s) including this one"]
        if b.trials is not None:
            parts.append(f"{self._trials_left()} trials")
        cpu, gpu = self._trial_hours()
        if b.cpu_hours is not None:
            parts.append(f"{max(0.0, b.cpu_hours - cpu):.2f} CPU core-hours")
        if b.gpu_hours is not None:
            parts.append(f"{max(0.0, b.gpu_hours - gpu):.2f} GPU-hours")
        if b.hours is not None:
            parts.append(f"{max(0.0, b.hours - self._seconds() / 3600):.2f} hours of wall time")
        if b.tokens is not None:
            parts.append(f"{max(0, b.tokens - self.state.tokens()):,} researcher tokens")
        return ", ".join(parts)

    def _seconds(self) -> float:
        return self.state.active_s + (time.monotonic() - self._started)

    def _earlier(self) -> list[dict[str, Any]]:
        """What the next plan is derived from: each earlier round's verdicts and report."""
        out = []
        for round_ in self.state.rounds[:-1]:
            item: dict[str, Any] = {"number": round_.number, "verdicts": round_.verdicts, "next": round_.next}
            if round_.phase == "abandoned":
                item["outcome"] = f"abandoned: {round_.reason}"
                item["errors"] = round_.problems[-1] if round_.problems else []
            else:
                item["outcome"] = f"{round_.decision}: {round_.reason or ''}"
                report = self.out / str(round_.study) / "report.md"
                item["report"] = report.read_text() if report.exists() else ""
            out.append(item)
        return out

    # -- the check server -------------------------------------------------------------------------
    def _check_server(self) -> str:
        """A server the checks play their episodes against: --check-server, or the embedded model
        serving only (started once, stopped when the loop ends)."""
        if self._check_url:
            return self._check_url
        from agentjet_client.research.launch import free_port

        port = free_port()
        log = self.out / "check-server.log"
        command = [*_server_program(), "up", "--serve-only", "--port", str(port), "--log-level", "warning"]
        command += ["--state-dir", str(self.out / "check-server"), "--fresh"]
        with log.open("ab") as f:
            self._check_process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        url = f"http://127.0.0.1:{port}"
        import httpx2

        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self._check_process.poll() is not None:
                from agentjet_client.research.trial import last_lines

                raise StudyError(f"the check server exited: {last_lines(log)}")
            try:
                if httpx2.get(url + "/healthz", timeout=2).status_code == 200:
                    self._check_url = url
                    return url
            except httpx2.HTTPError:
                pass
            time.sleep(0.5)
        raise StudyError(f"the check server did not answer within 300s; see {log}")

    def _stop_check_server(self) -> None:
        if self._check_process is None:
            return
        if self._check_process.poll() is None:
            self._check_process.send_signal(signal.SIGTERM)
            try:
                self._check_process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._check_process.kill()
        self._check_process = None
        self._check_url = None  # the one it started

    # -- state ------------------------------------------------------------------------------------
    def _open(self) -> AutoState:
        path = self.out / "auto.json"
        self.out.mkdir(parents=True, exist_ok=True)
        if path.exists():
            state = AutoState.model_validate_json(path.read_text())
            if state.topic != self.topic or Path(state.code_dir) != self.code_dir:
                raise StudyError(
                    f"{self.out} holds research on {state.topic!r} with {state.code_dir}; give a new --out, or the "
                    "same --topic and --code-dir to continue it"
                )
            state.finished = None  # a loop continued with larger budgets may go on
            done = sum(r.phase in ("done", "abandoned") for r in state.rounds)
            self.say(f"continuing the research in {self.out}: {done} round(s) done")
            self.researcher.usage.prompt, self.researcher.usage.completion = 0, 0
            return state
        if not (self.code_dir / "agent.py").exists() and not any(self.code_dir.glob("*.py")):
            raise StudyError(f"--code-dir {self.code_dir} holds no agent (no agent.py); give the agent's code dir")
        researcher = {"url": self.researcher.url, "model": self.researcher.model, "style": self.researcher.style}
        return AutoState(topic=self.topic, code_dir=str(self.code_dir), researcher=researcher)

    def _save(self) -> None:
        self.state.active_s = self._seconds()
        self._started = time.monotonic()
        write_atomic(self.out / "auto.json", self.state.model_dump_json(indent=1))

    def _log(self, kind: str, round_: Round, **values: Any) -> None:
        line = {"time": round(time.time(), 3), "round": round_.number, "kind": kind, **values}
        with (self.out / "log.jsonl").open("a") as f:
            f.write(json.dumps(line) + "\n")


def _die_with_parent() -> None:
    """In the check server's process before exec (Linux): SIGTERM when the loop's process dies, even
    by SIGKILL, so a killed loop leaves no server behind (elsewhere it is stopped on a clean exit)."""
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _verdict_problem(answer: str, ids: list[str]) -> str | None:
    try:
        verdict = json_answer(answer)
    except ValueError as exc:
        return str(exc)
    given = verdict.get("verdicts")
    if not isinstance(given, list):
        return '"verdicts" must be a list of {"id", "verdict", "evidence"}'
    named = {str(v.get("id")): v.get("verdict") for v in given if isinstance(v, dict)}
    missing = [i for i in ids if i not in named]
    if missing:
        return f"no verdict for {', '.join(missing)}"
    wrong = [i for i, v in named.items() if v not in VERDICTS]
    if wrong:
        return f"the verdict of {wrong[0]} must be one of {', '.join(VERDICTS)}"
    if verdict.get("decision") not in ("continue", "stop"):
        return '"decision" must be "continue" or "stop"'
    return None


def _server_program() -> list[str]:
    import shutil

    found = shutil.which("agentjet-server") or shutil.which("agentjet-server", path=str(Path(sys.executable).parent))
    if found is None:
        raise StudyError(
            "checks need agentjet-server to serve a model: pip install agentjet-server, or --check-server URL"
        )
    return [found]
