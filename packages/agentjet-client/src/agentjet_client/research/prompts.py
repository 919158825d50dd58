"""What ``research auto`` says to its researcher model. Every user message starts with a header line,
``[research auto] round N: plan | repair K | verdicts``, so a log (or a scripted researcher) can tell
the steps apart."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CODE_CHARS = 24_000  # of the user's agent code shown to the researcher
REPORT_CHARS = 16_000  # of a study report

SYSTEM = """You are the researcher of an automated reinforcement-learning study loop (AgentJet). An agent \
(Python code dir with agent.py and an @swarm_agent function returning a reward) is trained with GRPO on a \
served model. Each round you (1) state hypotheses about what makes the agent learn better, each with what \
would confirm and refute it; (2) write the agent-code variants that test them (a reward function, an \
environment wrapper, a prompt: full file texts replacing files of the code dir); (3) write a study file that \
trains them; then, after the study ran, (4) judge each hypothesis from its report.

Answer with one JSON object and nothing else.

A plan is:
{"hypotheses": [{"id": "h1", "statement": "...", "confirm_if": "...", "refute_if": "..."}],
 "variants": {"base": {"files": {}}, "NAME": {"about": "...", "files": {"agent.py": "<full text>"}}},
 "study": "<the study file, TOML>"}

The study file (TOML) tables:
[study] name, search = "grid" | "random" (with trials = N), metric = "eval_reward" (the agent needs eval_tasks) \
or "train_reward"
[trial] episodes = N (per trial), minutes = M (optional cap), eval_episodes = N
[server] agentjet-server up options shared by every trial, e.g. batch_groups = 10, seed = 0
[client] code_dir = "variants/base", concurrency = 32, env = { NAME = "value" }
[space] what is searched: "server.lr" = [1e-3, 3e-3], "client.code_dir" = ["variants/base", "variants/NAME"]
[stop] window = 400 (episodes per reward point), max_drop = 0.5 (stop a collapsing trial)
Optional: [pbt] every_episodes = N (population-based training over server.* settings), \
[[adjust]] when = "approx_kl > 0.05", set = { lr = "x0.5" }.
Every code_dir is variants/NAME of a variant in your plan; keep every path inside the round's directory.

Verdicts are:
{"verdicts": [{"id": "h1", "verdict": "confirmed" | "refuted" | "inconclusive", "evidence": "numbers from the \
report"}], "decision": "continue" | "stop", "reason": "...", "next": "what the next round (or a person) should try"}
"""


def code_listing(code_dir: Path) -> str:
    """The text files of the user's code dir, each under its name, up to ``CODE_CHARS``."""
    parts, used = [], 0
    for path in sorted(code_dir.rglob("*")):
        if not path.is_file() or "__pycache__" in path.parts or any(p.startswith(".") for p in path.parts):
            continue
        if path.suffix not in (".py", ".toml", ".txt", ".md", ".json", ".yaml", ".yml", ".jsonl"):
            continue
        text = path.read_text(errors="replace")
        block = f"--- {path.relative_to(code_dir)} ---\n{text}\n"
        if used + len(block) > CODE_CHARS:
            parts.append(f"--- {path.relative_to(code_dir)} --- (left out: the listing is at its limit)\n")
            continue
        parts.append(block)
        used += len(block)
    return "".join(parts)


def earlier_rounds(out: Path, rounds: list[Any]) -> list[dict[str, Any]]:
    """What the next plan is derived from: each earlier round's verdicts and report (``rounds``:
    ``autostate.Round`` s)."""
    found = []
    for round_ in rounds:
        item: dict[str, Any] = {"number": round_.number, "verdicts": round_.verdicts, "next": round_.next}
        if round_.phase == "abandoned":
            item["outcome"] = f"abandoned: {round_.reason}"
            item["errors"] = round_.problems[-1] if round_.problems else []
        else:
            item["outcome"] = f"{round_.decision}: {round_.reason or ''}"
            report = out / str(round_.study) / "report.md"
            item["report"] = report.read_text() if report.exists() else ""
        found.append(item)
    return found


def plan_prompt(number: int, topic: str, code: str, earlier: list[dict[str, Any]], budget: str) -> str:
    lines = [
        f"[research auto] round {number}: plan",
        "",
        f"Research topic: {topic}",
        "",
        f"Budget left: {budget}",
        "",
        "The agent's code dir (every variant starts as a copy of it):",
        code,
    ]
    if earlier:
        lines += ["", "Earlier rounds, with their reports (derive this round from them):"]
        for round_ in earlier:
            lines += ["", f"## Round {round_['number']}: {round_['outcome']}"]
            for verdict in round_.get("verdicts", []):
                lines.append(f"- {verdict['id']} {verdict['verdict']}: {verdict.get('evidence', '')}")
            if round_.get("next"):
                lines.append(f"Next, as that round's verdicts said: {round_['next']}")
            if round_.get("report"):
                lines += ["", round_["report"][:REPORT_CHARS]]
            if round_.get("errors"):
                lines += ["Its checks failed with:", *(f"- {e}" for e in round_["errors"])]
    lines += ["", "Answer with the plan (one JSON object)."]
    return "\n".join(lines)


def repair_prompt(number: int, attempt: int, problems: list[str]) -> str:
    return "\n".join(
        [
            f"[research auto] round {number}: repair {attempt}",
            "",
            "Your plan failed its checks:",
            *(f"- {p}" for p in problems),
            "",
            "Answer with the whole corrected plan (one JSON object): every variant and the study file.",
        ]
    )


def verdict_prompt(number: int, hypotheses: list[dict[str, Any]], report: str, status: dict[str, Any]) -> str:
    trials = [
        {k: t.get(k) for k in ("trial", "status", "metric", "episodes", "settings", "reason")} for t in status["trials"]
    ]
    return "\n".join(
        [
            f"[research auto] round {number}: verdicts",
            "",
            "The hypotheses of this round:",
            json.dumps(hypotheses, indent=1),
            "",
            "The study's trials:",
            json.dumps(trials, indent=1),
            "",
            "The study's report:",
            report[:REPORT_CHARS],
            "",
            "Judge every hypothesis (confirmed, refuted or inconclusive, with the numbers that decide it), then "
            "decide whether another round is worth its budget. Answer with the verdicts (one JSON object).",
        ]
    )


VERDICTS = ("confirmed", "refuted", "inconclusive")


def verdict_problem(answer: str, ids: list[str]) -> str | None:
    """What keeps ``answer`` from being the verdicts asked for (every hypothesis in ``ids`` judged), or None."""
    from agentjet_client.research.researcher import json_answer

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
