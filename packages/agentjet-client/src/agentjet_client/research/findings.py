"""``OUT/findings.md``: what ``research auto`` found, written after every round from its files.

The topic and the researcher; per round its hypotheses with their verdicts and evidence, the study
that tested them with the plots that decide them; the best configuration over every round (its
code dir and job file); what failed and why (abandoned rounds with their errors, trials that
failed or stopped early); what to try next; the budgets used.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from agentjet_client.research.autostate import AutoState, Round
from agentjet_client.research.trial import write_atomic


def write_findings(out: Path, state: AutoState) -> Path:
    lines = [
        f"# Findings: {state.topic}",
        "",
        f"Researcher: `{state.researcher['model']}` ({state.researcher['style']} API at "
        f"{state.researcher['url'] or 'its default URL'}). Agent: `{state.code_dir}`. "
        f"{len(state.rounds)} round(s); {state.usage['calls']} researcher calls, "
        f"{state.usage['prompt']:,} prompt + {state.usage['completion']:,} completion tokens; "
        f"wall time {state.active_s / 60:.1f} min."
        + (f" Ended: {state.finished}." if state.finished else " Still running."),
        "",
    ]
    best = _best(out, state)
    lines += ["## Best configuration", ""]
    if best is None:
        lines.append("No trial has finished its budget yet.")
    else:
        round_, trial = best
        code = trial["settings_now"].get("client.code_dir")
        lines += [
            f"Round {round_.number}, trial **{trial['id']}**: metric **{trial['metric']:.3f}** with "
            + ", ".join(f"`{k}` = {v}" for k, v in trial["settings_now"].items())
            + ".",
            "",
            f"- job file: `{round_.study}/best-server.toml` (`agentjet-server up --config` it)",
            f"- code dir: `{round_.folder}/{code if code else 'variants'}`",  # code dirs are relative to the study
            f"- study report: [{round_.study}/report.md]({round_.study}/report.md)",
        ]
    for round_ in state.rounds:
        lines += ["", *_round_section(out, round_)]
    lines += ["", "## What failed", ""]
    failures = _failures(out, state)
    lines += failures or ["Nothing failed."]
    lines += ["", "## What to try next", ""]
    nexts = [r.next for r in state.rounds if r.next]
    lines.append(nexts[-1] if nexts else "The researcher has not said yet.")
    path = out / "findings.md"
    write_atomic(path, "\n".join(lines) + "\n")
    return path


def _round_section(out: Path, round_: Round) -> list[str]:
    plan = round_.plan or {}
    lines = [f"## Round {round_.number} ({round_.phase})", ""]
    hypotheses = [h for h in plan.get("hypotheses", []) if isinstance(h, dict)]
    verdicts = {str(v.get("id")): v for v in round_.verdicts}
    if hypotheses:
        lines += ["| hypothesis | confirmed if | refuted if | verdict | evidence |", "|---|---|---|---|---|"]
        for h in hypotheses:
            verdict = verdicts.get(str(h.get("id")), {})
            cells = [
                f"**{h.get('id')}** {h.get('statement', '')}",
                str(h.get("confirm_if", "")),
                str(h.get("refute_if", "")),
                f"**{verdict.get('verdict', 'not judged yet')}**",
                str(verdict.get("evidence", "")),
            ]
            lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
        lines.append("")
    variants = plan.get("variants") if isinstance(plan.get("variants"), dict) else {}
    if variants:
        described = [
            f"`{name}`" + (f": {v.get('about')}" if isinstance(v, dict) and v.get("about") else "")
            for name, v in variants.items()
        ]
        lines += [f"Variants ({round_.folder}/variants): " + "; ".join(described) + ".", ""]
    if round_.study:
        report = out / round_.study / "report.md"
        lines.append(
            f"Study: `{round_.folder}/study.toml` ({(round_.checked or {}).get('trials', '?')} trials); report "
            f"[{round_.study}/report.md]({round_.study}/report.md)."
            + (f" Stopped early: {round_.budget_stop}." if round_.budget_stop else "")
        )
        plots = sorted((out / round_.study / "plots").glob("*.png")) if report.exists() else []
        decisive = [p for p in plots if p.name.startswith(("metric_vs_", "eval_vs_episodes", "reward_vs_episodes"))]
        for plot in decisive:
            lines += ["", f"![{plot.stem}]({plot.relative_to(out)})"]
    if round_.decision:
        lines += ["", f"Decision: **{round_.decision}**" + (f": {round_.reason}" if round_.reason else "")]
    elif round_.phase == "abandoned":
        lines += ["", f"Abandoned: {round_.reason}."]
    return lines


def _best(out: Path, state: AutoState) -> tuple[Round, dict[str, Any]] | None:
    best = None
    for round_ in state.rounds:
        if round_.study is None:
            continue
        for path in sorted((out / round_.study / "trials").glob("t*/trial.json")):
            record = json.loads(path.read_text())
            if record.get("status") != "finished" or record.get("metric") is None:
                continue
            trial = {
                "id": record["id"],
                "metric": record["metric"],
                "settings_now": {**record.get("settings", {}), **record.get("changed", {})},
            }
            if best is None or trial["metric"] > best[1]["metric"]:
                best = (round_, trial)
    return best


def _failures(out: Path, state: AutoState) -> list[str]:
    lines = []
    for round_ in state.rounds:
        for attempt, problems in enumerate(round_.problems, 1):
            fate = (
                "abandoned the round" if round_.phase == "abandoned" and attempt == len(round_.problems) else "repaired"
            )
            lines.append(
                f"- round {round_.number}, plan {attempt} failed its checks ({fate}): " + "; ".join(problems)[:1500]
            )
        if round_.study is None:
            continue
        for path in sorted((out / round_.study / "trials").glob("t*/trial.json")):
            record = json.loads(path.read_text())
            if record.get("status") in ("failed", "stopped"):
                lines.append(
                    f"- round {round_.number}, trial {record['id']} {record['status']}: {record.get('reason')}"
                )
    return lines


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")
