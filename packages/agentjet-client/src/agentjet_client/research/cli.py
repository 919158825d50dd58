"""``agentjet-client research run | status | report``: the study runner's commands."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from agentjet_client.errors import AgentJetError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Automated research: run a study of many training runs, watch it, read its report.",
)
console = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)


def _fail(message: str) -> None:
    err.print(f"[red]error:[/red] {escape(message)}")
    raise typer.Exit(code=2)


@app.command()
def run(
    study_file: Annotated[Path, typer.Argument(help="the study (TOML): search space, budgets, base server and client")],
    out: Annotated[Path, typer.Option(help="the study's directory: trials, logs, report (reuse it to continue)")],
    log_level: Annotated[str, typer.Option(help="logging level")] = "warning",
) -> None:
    """Run a study: each trial its own server and client, early stopping, crash resume, a report.

    Example (the worked study in docs/research.md: two learning rates x two
    group sizes on the demo):
    agentjet-client research run examples/research/digits_study.toml \\
      --out runs/digits

    Killed or interrupted, the same command continues: finished trials are
    kept, running ones are re-attached or resumed from their checkpoints.
    Watch it from another shell with
    agentjet-client research status runs/digits
    """
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from agentjet_client.research.runner import StudyRunner

    def say(message: str) -> None:
        console.print(f"[dim]{time.strftime('%H:%M:%S')}[/dim] {escape(message)}")

    try:
        runner = StudyRunner(study_file, out, say=say)
        runner.run()
    except AgentJetError as exc:
        _fail(str(exc))
    except KeyboardInterrupt:
        raise typer.Exit(code=130) from None
    _show(out.resolve())
    console.print(f"[bold]report[/bold]: {out.resolve() / 'report.md'}")
    failed = _all_failed(out.resolve())
    if failed:
        _fail(f"every trial failed ({failed}); see each trial's server.log and client.log under {out / 'trials'}")


def _all_failed(out: Path) -> str | None:
    """The trials' reasons, when every trial of the study failed (None otherwise)."""
    from agentjet_client.research.report import load_records

    records = load_records(out)
    if records and all(r.status == "failed" for r in records):
        return "; ".join(sorted({f"{r.id}: {r.reason}" for r in records})[:3])
    return None


@app.command()
def auto(
    topic: Annotated[str, typer.Option(help="the research topic, in words")],
    code_dir: Annotated[Path, typer.Option(help="the agent's code dir (never changed: variants are copies)")],
    out: Annotated[Path, typer.Option(help="everything the research writes (reuse it to continue)")],
    llm_url: Annotated[
        str | None,
        typer.Option(
            help="the researcher's endpoint (OpenAI- or Anthropic-compatible base URL)",
            envvar="AGENTJET_RESEARCH_URL",
            show_envvar=True,
        ),
    ] = None,
    llm_model: Annotated[
        str, typer.Option(help="the researcher model's name", envvar="AGENTJET_RESEARCH_MODEL", show_envvar=True)
    ] = "gpt-5",
    llm_api: Annotated[
        str,
        typer.Option(help="openai or anthropic (the endpoint's API)", envvar="AGENTJET_RESEARCH_API", show_envvar=True),
    ] = "openai",
    rounds: Annotated[int, typer.Option(min=1, help="rounds at most")] = 3,
    trials: Annotated[int | None, typer.Option(min=1, help="trials at most, over every round")] = None,
    cpu_hours: Annotated[float | None, typer.Option(min=0, help="CPU core-hours of trials at most")] = None,
    gpu_hours: Annotated[float | None, typer.Option(min=0, help="GPU-hours of trials at most")] = None,
    hours: Annotated[float | None, typer.Option(min=0, help="wall-clock hours at most")] = None,
    tokens: Annotated[int | None, typer.Option(min=1, help="researcher tokens (prompt + answer) at most")] = None,
    check_server: Annotated[
        str | None, typer.Option(help="a server the plans' checks play against (default: the embedded model)")
    ] = None,
    log_level: Annotated[str, typer.Option(help="logging level")] = "warning",
) -> None:
    """Research a topic unattended: an LLM writes hypotheses, agent variants and studies; AgentJet runs them.

    Each round the researcher plans (hypotheses, code variants, a study
    file), the plan is checked (each variant plays one episode in its own
    interpreter; the study validates) and repaired from the errors, the
    study runs, and the researcher judges each hypothesis from its report.
    The key comes from AGENTJET_RESEARCH_API_KEY (or OPENAI_API_KEY /
    ANTHROPIC_API_KEY). Findings: OUT/findings.md. Killed, the same command
    continues. Example (the endpoint and model from AGENTJET_RESEARCH_URL
    and AGENTJET_RESEARCH_MODEL, or --llm-url and --llm-model):
    agentjet-client research auto --topic rewards --code-dir DIR --out runs/a
    """
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from agentjet_client.research.auto import AutoResearch
    from agentjet_client.research.autostate import Budgets
    from agentjet_client.research.researcher import Researcher

    if llm_api not in ("openai", "anthropic"):
        _fail(f"--llm-api {llm_api!r}: give openai or anthropic")

    def say(message: str) -> None:
        console.print(f"[dim]{time.strftime('%H:%M:%S')}[/dim] {escape(message)}")

    budgets = Budgets(rounds, trials, cpu_hours, gpu_hours, hours, tokens)
    researcher = Researcher(llm_url or "", llm_model, llm_api)  # type: ignore[arg-type]
    try:
        state = AutoResearch(topic, code_dir, out, researcher, budgets, check_server, say=say).run()
    except AgentJetError as exc:
        _fail(str(exc))
    except KeyboardInterrupt:
        raise typer.Exit(code=130) from None
    console.print(f"[bold]findings[/bold]: {out.resolve() / 'findings.md'} ({state.finished})")


@app.command()
def check(
    study_file: Annotated[Path, typer.Argument(help="the study (TOML) to check")],
    json_out: Annotated[bool, typer.Option("--json", help="print what it plans as JSON")] = False,
) -> None:
    """Check a study file and its agents' code dirs without running anything: every problem at once.

    Example: agentjet-client research check examples/research/digits_study.toml
    """
    import json

    from agentjet_client.research.study import load_study, machine_parallel

    try:
        study, _ = load_study(study_file)
    except AgentJetError as exc:
        _fail(str(exc))
    configurations = study.configurations()
    parallel, why = machine_parallel(study.study, len(configurations) if study.pbt else None)
    plan = {
        "trials": len(configurations),
        "search": study.study.search,
        "metric": study.study.metric,
        "parallel": parallel,
        "cores_per_trial": study.study.cores_per_trial,
        "devices": study.study.devices,
        "episodes_per_trial": study.trial.episodes,
        "minutes_per_trial": study.trial.minutes,
        "code_dirs": sorted({str(study.client_settings(c, study_file.parent).code_dir) for c in configurations}),
    }
    if json_out:
        console.print_json(json.dumps(plan))
        return
    console.print(
        f"{study_file}: a valid study; {plan['trials']} trials ({plan['search']}), metric {plan['metric']}, "
        f"{parallel} at once ({escape(why)})"
    )


@app.command()
def status(out: Annotated[Path, typer.Argument(help="the study's --out directory")]) -> None:
    """Show a study's progress: every trial's phase, episodes, reward, metric and why it ended.

    Example: agentjet-client research status runs/digits
    """
    if not (out / "study.json").exists():
        _fail(f"{out} holds no study (no study.json); give the --out of `agentjet-client research run`")
    _show(out.resolve())


@app.command()
def report(out: Annotated[Path, typer.Argument(help="the study's --out directory")]) -> None:
    """Write the study's report again (report.md, plots/, best-server.toml) from its files.

    Example: agentjet-client research report runs/digits
    """
    from agentjet_client.research.study import study_of

    if not (out / "study.json").exists():
        _fail(f"{out} holds no study (no study.json); give the --out of `agentjet-client research run`")
    try:
        study = study_of(out)
        from agentjet_client.research.report import write_report

        path = write_report(out.resolve(), study)
    except AgentJetError as exc:
        _fail(str(exc))
    console.print(f"report: {path}")


def _show(out: Path) -> None:
    from agentjet_client.research.report import load_records
    from agentjet_client.research.study import study_of
    from agentjet_client.research.trial import load_state

    state = load_state(out)
    records = load_records(out)
    state_metric = study_of(out).study.metric
    done = sum(r.phase == "done" for r in records)
    running = [r for r in records if r.phase not in ("pending", "interrupted", "done")]
    work = [
        (r.target_episodes if r.phase == "done" else min(r.episodes, r.target_episodes), r.target_episodes)
        for r in records
    ]
    share = sum(a for a, _ in work) / max(1, sum(b for _, b in work))  # a trial that ended counts whole
    runner = "finished" if state.finished_at else ("running" if _runner_alive(out) else "not running")
    console.print(
        f"study [bold]{escape(state.name)}[/bold] ({out}): {done}/{len(records)} trials done, {len(running)} running; "
        f"{share:.0%} of the work; study time {state.seconds() / 60:.1f} min; runner {runner}"
    )
    if runner == "not running":
        console.print(f"  continue it with: agentjet-client research run {state.study_file} --out {out}")
    for r in records:  # a line per trial (grep-able; a table would wrap in a narrow terminal or a log)
        settings = "  ".join(f"{k.split('.', 1)[-1]}={v}" for k, v in r.settings.items())
        phase = r.status if r.phase == "done" else r.phase
        reward = f"reward {r.last_reward:.3f}" if r.last_reward is not None else "reward -"
        metric = f"{state_metric}={r.metric:.3f}" if r.metric is not None else f"{state_metric}=-"
        resumes = f"  resumes {r.resumes}" if r.resumes else ""
        note = r.reason if r.phase == "done" else (r.events[-1] if r.events else "")
        console.print(
            f"  [bold]{r.id}[/bold] {phase:<10} {r.episodes:>7,}/{r.target_episodes:<7,} {reward}  {metric}{resumes}"
            f"  {escape(settings)}" + (f"\n        {escape(note)}" if note else "")
        )


def _runner_alive(out: Path) -> bool:
    from agentjet_client.research.trial import RunnerLock

    return RunnerLock(out).held_elsewhere()
