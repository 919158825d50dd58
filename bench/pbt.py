"""Population-based training against the same trials with fixed settings, on the demo task.

    python bench/pbt.py [--runs 3] [--episodes 8000] [--lrs 1e-4,3e-4,1e-3,3e-3] [--out runs/bench-pbt]

Each run is two studies of ``agentjet-client research run`` on the demo's digits task (all ten
digits) with the embedded model, one trial per learning rate, every trial of a study at once and
the same budget of ``--episodes`` training episodes per trial:

  fixed  a grid: each trial keeps its learning rate;
  pbt    the same grid with ``[pbt]``: every ``--every`` episodes (from ``--burn-in`` on) the worse quarter of
         the trials
         takes the checkpoint of one of the better quarter (when it leads by 2 standard errors) and
         explores its learning rate x0.8 or x1.25, or (one time in four) a fresh draw from the grid.

Both studies of a run use the same seeds (``[server] seed`` and the client's ``--seed`` are the run
number). Reported per run: each study's best trial by the final evaluation (``--eval-episodes``, 100
by default, on the ten prompts, never trained), the fixed trials' metrics, the exploit/explore steps
PBT took, and whether PBT's best is not below the best fixed trial. ``--json FILE`` keeps every figure
(written after every study).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

STUDY = """
[study]
name = "{name}"
search = "grid"
metric = "eval_reward"
parallel = {parallel}
max_resumes = 1
poll_seconds = 1.0

[trial]
episodes = {episodes}
eval_episodes = {eval_episodes}

[server]
batch_groups = 10
seed = {seed}

[client]
code_dir = "{code_dir}"
concurrency = 32
seed = {seed}

[space]
"server.lr" = [{lrs}]

[stop]
window = 400
{pbt}
"""

PBT = """
[pbt]
every_episodes = {every}
burn_in_episodes = {burn_in}
quantile = 0.25
perturb = [0.8, 1.25]
resample = 0.25
points = 2
"""


def run_study(kind: str, args: argparse.Namespace, run: int) -> dict[str, Any]:
    folder = args.out / f"run{run}" / kind
    folder.mkdir(parents=True, exist_ok=True)
    lrs = [float(x) for x in args.lrs.split(",")]
    text = STUDY.format(
        name=f"{kind} run {run}",
        parallel=len(lrs),
        episodes=args.episodes,
        eval_episodes=args.eval_episodes,
        seed=run,
        code_dir=ROOT / "examples" / "digits",
        lrs=", ".join(repr(x) for x in lrs),
        pbt=PBT.format(every=args.every, burn_in=args.burn_in) if kind == "pbt" else "",
    )
    study = folder / "study.toml"
    study.write_text(text)
    out = folder / "out"
    started = time.monotonic()
    log = folder / "runner.log"
    with log.open("w") as f:
        code = subprocess.call(
            [sys.executable, "-m", "agentjet_client", "research", "run", str(study), "--out", str(out)],
            stdout=f,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    if code != 0:
        raise SystemExit(f"the {kind} study of run {run} failed ({code}); see {log}")
    trials = []
    for path in sorted((out / "trials").glob("t*/trial.json")):
        record = json.loads(path.read_text())
        trials.append(
            {
                "id": record["id"],
                "lr": record["settings"]["server.lr"],
                "lr_now": record["changed"].get("server.lr", record["settings"]["server.lr"]),
                "metric": record["metric"],
                "status": record["status"],
                "exploits": record.get("exploits", 0),
                "episodes": record["episodes"],
            }
        )
    changes = (out / "changes.jsonl").read_text().splitlines() if (out / "changes.jsonl").exists() else []
    scored = [t for t in trials if t["metric"] is not None]
    best = max(scored, key=lambda t: t["metric"]) if scored else None
    return {
        "kind": kind,
        "run": run,
        "seconds": time.monotonic() - started,
        "trials": trials,
        "best": best,
        "exploits": sum(json.loads(x)["kind"] == "exploit" for x in changes),
        "report": str(out / "report.md"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--first-run", type=int, default=0, help="the first run's number (its seed): continue a series")
    parser.add_argument("--episodes", type=int, default=8000, help="training episodes per trial")
    parser.add_argument("--every", type=int, default=1600, help="PBT: episodes between a trial's ready points")
    parser.add_argument("--burn-in", type=int, default=0, help="PBT: episodes before a trial is first ready")
    parser.add_argument(
        "--eval-episodes", type=int, default=100, help="each trial's final evaluation (standard error ~0.03 at 100)"
    )
    parser.add_argument("--lrs", default="1e-4,3e-4,1e-3,3e-3")
    parser.add_argument("--out", type=Path, default=Path("runs/bench-pbt"))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    args.out = args.out.resolve()
    results = []
    runs = range(args.first_run, args.first_run + args.runs)
    for run in runs:
        for kind in ("fixed", "pbt"):
            print(f"run {run}: {kind} study ...", flush=True)
            result = run_study(kind, args, run)
            results.append(result)
            if args.json:  # after every study: a run cut off keeps what it measured
                args.json.write_text(json.dumps(results, indent=1))
            best = result["best"]
            print(
                f"  {result['seconds']:.0f}s; best {best['id'] if best else '-'} "
                f"(lr {best['lr']:g} -> {best['lr_now']:g}) eval {best['metric']:.3f}; "
                f"{result['exploits']} exploits; "
                + "  ".join(
                    f"{t['id']} lr {t['lr']:g}: {t['metric'] if t['metric'] is None else round(t['metric'], 3)}"
                    for t in result["trials"]
                ),
                flush=True,
            )
    print("\n| run | best fixed (lr, eval) | best PBT (lr start -> end, eval) | PBT exploits | PBT >= fixed |")
    print("|---:|---|---|---:|---|")
    for run in runs:
        fixed, pbt = (next(r for r in results if r["run"] == run and r["kind"] == k) for k in ("fixed", "pbt"))
        f, p = fixed["best"], pbt["best"]
        print(
            f"| {run} | {f['id']} ({f['lr']:g}, {f['metric']:.3f}) | {p['id']} ({p['lr']:g} -> {p['lr_now']:g}, "
            f"{p['metric']:.3f}) | {pbt['exploits']} | {'yes' if p['metric'] >= f['metric'] else 'no'} |"
        )


if __name__ == "__main__":
    main()
