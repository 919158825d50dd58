"""What a study found: ``DIR/report.md`` (a leaderboard of every trial, its settings, its metric and
why it ended), ``DIR/best-server.toml`` (the best trial's server settings, a job file for
``agentjet-server up --config``) and ``DIR/plots/*.png`` (matplotlib: reward against episodes and
against running time for every trial, the metric against each searched setting).

It reads only the files the runner writes, so ``agentjet-client research report DIR`` rebuilds it
at any time, and the runner rewrites it whenever a trial finishes.
"""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path
from typing import Any

from agentjet_client.errors import extra_hint
from agentjet_client.research.study import Study, toml_text
from agentjet_client.research.trial import TrialDir, TrialRecord, load_state, write_atomic


def load_records(out: Path) -> list[TrialRecord]:
    state = json.loads((out / "study.json").read_text())
    return [TrialDir(out, trial_id).load() for trial_id in state["trials"]]


def ranked(records: list[TrialRecord]) -> list[TrialRecord]:
    """Best metric first; trials without one (failed, skipped, running) after, in trial order."""
    scored = sorted((r for r in records if r.metric is not None), key=lambda r: (-(r.metric or 0.0), r.index))
    return scored + [r for r in records if r.metric is None]


def best_trial(records: list[TrialRecord]) -> TrialRecord | None:
    """The best trial that ran its budget (one stopped early or failed is not a configuration to use)."""
    finished = [r for r in ranked(records) if r.status == "finished" and r.metric is not None]
    return finished[0] if finished else None


def write_report(out: Path, study: Study) -> Path:
    records = load_records(out)
    state = json.loads((out / "study.json").read_text())
    seconds = load_state(out).seconds()
    plots, plot_note = _plots(out, study, records)
    best = best_trial(records)
    keys = sorted(study.space)
    metric = study.study.metric
    counts = {s: sum(r.status == s for r in records) for s in ("finished", "stopped", "failed", "skipped")}
    running = sum(r.phase != "done" for r in records)
    lines = [
        f"# Study: {state['name']}",
        "",
        f"{study.study.search} search over {', '.join(f'`{k}`' for k in keys)}; metric `{metric}` (higher is better). "
        f"{len(records)} trials: {counts['finished']} finished, {counts['stopped']} stopped early, "
        f"{counts['failed']} failed, {counts['skipped']} skipped"
        + (f", {running} not done yet" if running else "")
        + ".",
        f"Study time {_duration(seconds)}; {state['parallel']} trial(s) at once "
        f"({state['parallel_reason']}). Study file: `study.toml`. Written {time.strftime('%Y-%m-%d %H:%M:%S')}.",
        "",
        "## Best configuration",
        "",
    ]
    lines += _best_section(out, study, state, best)
    lines += _leaderboard(study, records)
    lines += _changes(out, records)
    lines += ["", "## Plots", ""]
    if plots:
        lines += [f"![{title}](plots/{name})\n" for name, title in plots]
    else:
        lines.append(plot_note)
    lines += ["", "## Trials", ""]
    for record in records:
        lines.append(f"- **{record.id}** ({_settings(record.settings)}): {'; '.join(record.events[-8:]) or '-'}")
    path = out / "report.md"
    write_atomic(path, "\n".join(lines) + "\n")
    return path


def _best_section(out: Path, study: Study, state: dict[str, Any], best: TrialRecord | None) -> list[str]:
    """The best trial: its settings and metric, and the commands (with ``best-server.toml``, written here) that
    serve its trained weights and train them on."""
    metric = study.study.metric
    lines: list[str] = []
    if best is not None:  # its settings as they ended: population-based training and rules change them
        server = study.server_settings(best.current())
        client = study.client_settings(best.current(), Path(state["study_file"]).parent)
        command = client_command(client, server, best.target_episodes)
        trained = trained_model(out, best.id)
        if trained is not None:  # serve (or train on from) the best trial's weights, not the initial model
            server = {k: v for k, v in server.items() if k != "model_size"} | {"model": str(trained)}
        header = [
            f"best trial {best.id} of study '{state['name']}': {metric} {best.metric:.3f}",
            f"settings: {'  '.join(f'{k}={v}' for k, v in best.current().items())}",
            "serve its trained weights: agentjet-server up --config best-server.toml"
            if trained is not None
            else "its run wrote no checkpoint: this file trains the same settings from the initial model",
            f"train it:   {command}",
        ]
        write_atomic(out / "best-server.toml", "".join(f"# {h}\n" for h in header) + toml_text(server))
        lines += [
            f"**{best.id}**: {_settings(best.current())} — `{metric}` **{best.metric:.3f}** "
            f"after {best.episodes:,} episodes ({_duration(best.seconds())})"
            + (f"; it started with {_settings(best.settings)} and changed while it trained" if best.changed else "")
            + ".",
            "",
            "Ready to run (`best-server.toml` is an `agentjet-server up` job file with every server setting"
            + (
                f", and `model` the best trial's newest checkpoint, `{trained}`: the server serves the weights the "
                "trial trained, and a client run trains them on):"
                if trained is not None
                else "; the trial wrote no checkpoint, so it starts from the initial model):"
            ),
            "",
            "```bash",
            f"agentjet-server up --config {out / 'best-server.toml'}",
            command,
            "```",
        ]
    else:
        lines.append("No trial has finished its budget yet.")
    return lines


def _leaderboard(study: Study, records: list[TrialRecord]) -> list[str]:
    """Every trial ranked by its metric, with its settings, budget, time, resumes and how it ended."""
    keys = sorted(study.space)
    metric = study.study.metric
    lines: list[str] = []
    lines += ["", "## Leaderboard", ""]
    halving = study.study.search == "halving"
    columns = ["rank", "trial", *(f"`{k}`" for k in keys), metric, *(["rung"] if halving else [])]
    lines.append("| " + " | ".join([*columns, "episodes", "time", "resumes", "ended"]) + " |")
    lines.append("|---:|---|" + "---|" * len(keys) + "---:|" * (2 if halving else 1) + "---:|---:|---:|---|")
    for rank, record in enumerate(ranked(records), 1):
        value = f"{record.metric:.3f}" if record.metric is not None else "-"
        ended = record.status or record.phase
        why = f"{ended}: {record.reason}" if record.reason else ended
        cells = [str(rank) if record.metric is not None else "", record.id]
        cells += [_cell(record.settings.get(k)) for k in keys]
        cells += [
            value,
            *([str(record.rung)] if halving else []),
            f"{record.episodes:,}",
            _duration(record.seconds()),
            str(record.resumes),
            _escape(why),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _changes(out: Path, records: list[TrialRecord]) -> list[str]:
    """The "Live changes" section: every exploit, explore and rule the runner applied (``live.py``)."""
    from agentjet_client.research.live import read_changes

    changes = read_changes(out)
    if not changes:
        return []
    started = min((r.started_at for r in records if r.started_at), default=changes[0]["time"])
    lines = [
        "",
        "## Live changes",
        "",
        f"{sum(c['kind'] == 'exploit' for c in changes)} population-based training exploit/explore steps and "
        f"{sum(c['kind'] == 'adjust' for c in changes)} rule adjustments while trials trained "
        "(each also in the trial's events and its server's metrics.jsonl).",
        "",
        "| study time | trial | at episodes | what | why |",
        "|---:|---|---:|---|---|",
    ]
    for change in changes:
        before, after = change["before"], change["after"]
        settings = ", ".join(f"{k.removeprefix('server.')} {_cell(v)} -> {_cell(after[k])}" for k, v in before.items())
        if change["kind"] == "exploit":
            what = f"took {change['donor']}'s checkpoint (its step {change['donor_step']}); explore: {settings}"
            why = f"score {change['score']:.3f} against {change['donor']}'s {change['donor_score']:.3f}"
        else:
            what, why = settings, f"{change['figure']} {change['value']:.4g} (step {change['step']}): {change['rule']}"
        when = _duration(change["time"] - started)
        lines.append(f"| {when} | {change['trial']} | {change['episodes']:,} | {_escape(what)} | {_escape(why)} |")
    return lines


def client_command(client: Any, server: dict[str, Any], episodes: int) -> str:
    group = client.group_size or int(server.get("group_size", 16))
    env = "".join(f"{k}={v} " for k, v in client.env.items())
    parts = [
        f"{env}agentjet-client run --code-dir {client.code_dir} --server http://127.0.0.1:8000",
        f"--episodes {episodes} --group-size {group} --concurrency {client.concurrency}",
    ]
    if client.eval_every:
        parts.append(f"--eval-every {client.eval_every} --eval-episodes {client.eval_episodes}")
    return " ".join(parts + client.args)


def _plots(out: Path, study: Study, records: list[TrialRecord]) -> tuple[list[tuple[str, str]], str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return [], f"No plots: {extra_hint('the report', 'research', exc)}."
    folder = out / "plots"
    folder.mkdir(exist_ok=True)
    series = {r.id: TrialDir(out, r.id).points() for r in records}
    exploits: dict[str, list[int]] = {}
    from agentjet_client.research.live import read_changes

    for change in read_changes(out):
        if change["kind"] == "exploit":
            exploits.setdefault(change["trial"], []).append(change["episodes"])
    made: list[tuple[str, str]] = []
    for kind, label in (("train", "training reward"), ("eval", "evaluation reward")):
        kinds = (kind,) if kind == "train" else ("eval", "final")  # the final round closes each curve
        if not any(p["kind"] in kinds for points in series.values() for p in points):
            continue
        for x, xlabel, suffix in (("episodes", "training episodes", "episodes"), ("t", "running time (min)", "time")):
            fig, ax = plt.subplots(figsize=(8, 4.5))
            for record in records:
                points = [p for p in series[record.id] if p["kind"] in kinds]
                if not points:
                    continue
                along = [p[x] / 60 if x == "t" else p[x] for p in points]
                marker = "." if len(points) < 30 else None
                line = ax.plot(along, [p["reward"] for p in points], marker=marker, label=_legend(record))
                for at in exploits.get(record.id, []) if x == "episodes" else []:  # where it took a better checkpoint
                    ax.axvline(at, color=line[0].get_color(), linestyle=":", alpha=0.6)
                finals = [(a, p["reward"]) for a, p in zip(along, points, strict=True) if p["kind"] == "final"]
                if finals:
                    stars_x, stars_y = [a for a, _ in finals], [r for _, r in finals]
                    ax.scatter(stars_x, stars_y, marker="*", s=120, color=line[0].get_color(), zorder=3)
            ax.set_xlabel(xlabel)
            ax.set_ylabel(label)
            marks = " (dotted: exploits)" if exploits and x == "episodes" else ""
            final = " (*: final round)" if kind == "eval" else marks
            ax.set_title(f"{label} against {xlabel.split(' (')[0]}{final}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, loc="best")
            name = f"{'reward' if kind == 'train' else 'eval'}_vs_{suffix}.png"
            fig.tight_layout()
            fig.savefig(folder / name, dpi=100)
            plt.close(fig)
            made.append((name, f"{label} against {xlabel}"))
    made += _metric_plots(plt, folder, study, [r for r in records if r.metric is not None])
    return made, ""


def _metric_plots(plt: Any, folder: Path, study: Study, scored: list[TrialRecord]) -> list[tuple[str, str]]:
    """The metric of each scored trial against each searched setting: a plot a setting."""
    made: list[tuple[str, str]] = []
    for key in sorted(study.space):
        if not scored:
            break
        fig, ax = plt.subplots(figsize=(6, 4))
        values: list[Any] = [r.settings.get(key) for r in scored]
        metrics = [r.metric or 0.0 for r in scored]
        numeric = all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)
        if numeric:
            xs: list[Any] = values
            positive = [float(v) for v in values if v > 0]
            if len(positive) == len(values) and max(positive) >= 3 * min(positive):
                ax.set_xscale("log")
            distinct = sorted(set(values))
            if len(distinct) <= 8:  # the searched values themselves, as the study file writes them
                ax.set_xticks(distinct, [f"{v:g}" for v in distinct], fontsize=8)
                ax.minorticks_off()
        else:
            labels = sorted({str(v) for v in values})
            xs = [labels.index(str(v)) for v in values]
            ax.set_xticks(range(len(labels)), [Path(x).name if "/" in x else x for x in labels], fontsize=8)
        colours = ["tab:blue" if r.status == "finished" else "tab:red" for r in scored]
        ax.scatter(xs, metrics, c=colours)
        for x, y, record in zip(xs, metrics, scored, strict=True):
            ax.annotate(record.id, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel(key)
        ax.set_ylabel(study.study.metric)
        ax.set_title(f"{study.study.metric} against {key} (red: stopped early)")
        ax.grid(alpha=0.3)
        name = f"metric_vs_{re.sub(r'[^A-Za-z0-9_.-]', '_', key)}.png"
        fig.tight_layout()
        fig.savefig(folder / name, dpi=100)
        plt.close(fig)
        made.append((name, f"{study.study.metric} against {key}"))
    return made


def _legend(record: TrialRecord) -> str:
    return f"{record.id} " + " ".join(f"{k.split('.')[-1]}={_cell(v)}" for k, v in record.settings.items())


def trained_model(out: Path, trial_id: str) -> Path | None:
    """The model directory of the newest checkpoint the trial's server wrote, if any."""
    done = sorted((out / "trials" / trial_id / "state" / "checkpoints").glob("step-*"))
    models = [d / "model" for d in done if not d.name.endswith(".tmp") and (d / "model" / "config.json").exists()]
    return models[-1].resolve() if models else None


def _settings(settings: dict[str, Any]) -> str:
    return ", ".join(f"`{k}` = {_cell(v)}" for k, v in settings.items())


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, str) and "/" in value:
        return Path(value).name
    return str(value)


def _escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "-"
    return f"{seconds / 60:.1f} min" if seconds >= 90 else f"{seconds:.0f} s"
