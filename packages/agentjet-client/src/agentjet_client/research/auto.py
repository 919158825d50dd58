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
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentjet_client.errors import StudyError
from agentjet_client.research import prompts
from agentjet_client.research.autostate import AutoState, Budgets, Ledger, Round
from agentjet_client.research.following import StudyFollower
from agentjet_client.research.researcher import Researcher, json_answer
from agentjet_client.research.tools import ToolError, Workspace
from agentjet_client.research.trial import write_atomic
from agentjet_client.research.variants import CheckServer, check_round, write_round

MAX_ATTEMPTS = 3  # plans per round before it is abandoned
FORMAT_RETRIES = 2  # verdict answers that are not the JSON asked for, before the verdicts are called inconclusive


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
        self.checks = CheckServer(self.out, check_server)
        self.state = self._open()
        self.ledger = Ledger(self.state, budgets, self.out)
        self.follower = StudyFollower(self.workspace, self.ledger, say, self._log, self._save, poll_s)

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
            self.checks.stop()
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
        spent = self.ledger.spent()
        if spent:
            return self._finish(spent)
        if self.ledger.trials_left() == 0:
            return self._finish(f"the trial budget ({self.budgets.trials}) is used")
        round_ = Round(number=len(state.rounds) + 1)
        state.rounds.append(round_)
        self._log("round", round_, message="started")
        return round_

    def _advance(self, round_: Round) -> None:
        if round_.phase == "planning":
            self._plan(round_)
        elif round_.phase == "running":
            self.follower.follow(round_)
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
                    round_.number,
                    self.topic,
                    prompts.code_listing(self.code_dir),
                    prompts.earlier_rounds(self.out, self.state.rounds[:-1]),
                    self.ledger.budget_text(),
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
            self.checks.stop()  # the study needs the machine; the next round starts another
            round_.phase = "running"
            round_.study = f"{round_.folder}/study"
            trials = (round_.checked or {}).get("trials")
            self.say(f"round {round_.number}: the plan passed its checks ({trials} trials)")
            return
        round_.problems.append(problems)
        self.say(f"round {round_.number}: the plan failed its checks: {'; '.join(problems)[:600]}")
        if round_.attempts >= MAX_ATTEMPTS:
            self.checks.stop()
            round_.phase = "abandoned"
            round_.reason = f"its plan failed its checks {MAX_ATTEMPTS} times"
            self.say(f"round {round_.number}: abandoned ({round_.reason})")
            self._log("decision", round_, decision="abandoned", problems=problems)

    def _check(self, round_: Round, folder: Path) -> list[str]:
        try:
            server = self.checks.url()
        except StudyError as exc:
            raise StudyError(f"cannot check plans: {exc}") from exc
        self.say(f"round {round_.number}: checking the plan (each variant plays one episode in its own interpreter)")
        problems, checked = check_round(folder, self.out, self.workspace, server, self.ledger.trials_left())
        round_.checked = checked
        return problems

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
            problem = prompts.verdict_problem(answer, ids)
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
            problem = prompts.verdict_problem(answer, ids)
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
        self.ledger.checkpoint()
        write_atomic(self.out / "auto.json", self.state.model_dump_json(indent=1))

    def _log(self, kind: str, round_: Round, **values: Any) -> None:
        line = {"time": round(time.time(), 3), "round": round_.number, "kind": kind, **values}
        with (self.out / "log.jsonl").open("a") as f:
            f.write(json.dumps(line) + "\n")
