"""Asynchronous swarm training against synchronous rollout-then-train, on a slow, long-tailed environment.

    python bench/async_vs_sync.py [--seconds 60] [--seeds 0,1,2] [--bounds 1,4,8] [--modes decoupled,tis,none]

The same agent, task and server settings in every run: the demo's digits task (``Write three as a
digit.`` -> ``3``, reward 1 for the right digit) on the embedded model, where each episode makes
one model call and then spends a log-normal time in its environment (median ``--env-median``
seconds, sigma ``--env-sigma``: with sigma 1, one episode in 90 takes over 10x the median, one in
10 over 3.6x). Each run lasts ``--seconds`` of wall clock, with ``--concurrency`` episodes at once.

  sync           ``agentjet-client run --sync``: start one batch (batch_groups x group_size episodes),
                 wait for all of them, wait for the step, repeat. Staleness 0.
  async, bound S the swarm: episodes start whenever admission allows, with ``--max-staleness S``
                 and ``--admission-batches S`` (rollouts may run up to S batches ahead of the
                 learner), under each ``--off-policy`` mode.

Reported per configuration, mean over seeds (min-max in brackets where it matters): learner steps
per minute and the ratio to sync, the learner's idle fraction (1 - time in steps and weight
updates / wall clock), episodes per second, the mean version lag of trained tokens, the reward over
the last 20% of episodes, the reward over the first N episodes of every run (N: the fewest any run
finished, so every configuration is compared on the same episodes), and the reward against
episodes and against wall clock (means over quarters of each). ``--json FILE`` keeps every run's
figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx2

from _server import served
from agentjet_client import RunConfig, Runner, SwarmClient, swarm_agent
from agentjet_client.tasks.agent import SwarmAgent

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def make_agent(digits: list[int], median: float, sigma: float, seed: int) -> SwarmAgent:
    rng = random.Random(seed)
    tasks = [{"id": f"digit-{d}", "word": WORDS[d], "answer": str(d)} for d in digits]

    @swarm_agent(tasks=tasks)
    async def agent(task: dict[str, Any], episode: Any) -> float:
        reply = await episode.async_openai().chat.completions.create(
            model="agentjet-tiny",
            messages=[{"role": "user", "content": f"Write {task['word']} as a digit."}],
            max_tokens=4,
            temperature=1.0,
        )
        await asyncio.sleep(median * math.exp(sigma * rng.gauss(0.0, 1.0)))  # the environment
        return 1.0 if (reply.choices[0].message.content or "").strip() == task["answer"] else 0.0

    return agent


def one_run(
    model_dir: Path, name: str, server_args: list[str], sync: bool, seed: int, args: argparse.Namespace
) -> dict:
    agent = make_agent([int(d) for d in args.digits.split(",")], args.env_median, args.env_sigma, seed)
    common = ["--batch-groups", str(args.batch_groups), "--group-size", str(args.group_size), "--seed", str(seed)]
    common += ["--lr", str(args.lr), "--checkpoint-every", "0", *shlex.split(args.server_extra)]
    with served(model_dir, *common, *server_args) as url, SwarmClient(url) as client:
        finished: list[tuple[float, float]] = []  # (seconds since start, reward) of complete episodes
        started = time.monotonic()

        def progress(report: Any) -> None:
            while len(finished) < len(report.rewards):
                finished.append((time.monotonic() - started, report.rewards[len(finished)]))

        config = RunConfig(
            episodes=0,
            group_size=args.group_size,
            concurrency=args.concurrency,
            timeout=args.episode_timeout,
            seed=seed,
            sync=sync,
        )
        runner = Runner(client, agent, config, on_progress=progress)

        async def bounded() -> Any:
            asyncio.get_running_loop().call_later(args.seconds, runner.stop)
            return await runner.run()

        report = asyncio.run(bounded())
        elapsed = time.monotonic() - started
        status = client.status()
        lines = httpx2.get(url + "/v1/metrics/history", params={"kind": "step", "limit": 100000}).json()["lines"]
    busy = sum(line["step_seconds"] + line["weight_update_seconds"] for line in lines)
    stepping = sum(line["step_seconds"] for line in lines)
    preparing = sum(line.get("prepare_seconds") or 0.0 for line in lines)
    weights = [line["is_weight_mean"] for line in lines if line.get("is_weight_mean") is not None]
    truncated = [line["is_truncated_fraction"] for line in lines if line.get("is_truncated_fraction") is not None]
    lag = {int(k): n for k, n in status.learner.trained_token_lag.items()}
    rewards = [r for _, r in finished]
    tail = rewards[int(0.8 * len(rewards)) :]
    return {
        "name": name,
        "seed": seed,
        "seconds": elapsed,
        "steps": status.learner.step,
        "steps_per_min": 60.0 * status.learner.step / elapsed,
        "idle": max(0.0, 1.0 - busy / elapsed),
        "episodes_per_s": report.finished / elapsed,
        "prepare_share": preparing / stepping if stepping else 0.0,
        "is_truncated": statistics.fmean(truncated) if truncated else 0.0,
        "is_weight": statistics.fmean(weights) if weights else 1.0,
        "lag_mean": sum(k * n for k, n in lag.items()) / max(1, sum(lag.values())),
        "lag_max": max(lag) if lag else 0,
        "stale_at_training": status.learner.stale_at_training,
        "rejected": report.rejected,
        "reward_last20": statistics.fmean(tail) if tail else math.nan,
        "reward_by_episodes": quarters(rewards),
        "reward_by_time": [
            statistics.fmean([r for t, r in finished if lo <= t < hi] or [math.nan])
            for lo, hi in ((q * args.seconds / 4, (q + 1) * args.seconds / 4) for q in range(4))
        ],
        "episodes": len(rewards),
        "rewards": rewards,
    }


def quarters(values: list[float]) -> list[float]:
    n = len(values)
    return [statistics.fmean(values[q * n // 4 : (q + 1) * n // 4] or [math.nan]) for q in range(4)]


def mean(rows: list[dict], key: str) -> float:
    return statistics.fmean(r[key] for r in rows)


def spread(rows: list[dict], key: str, fmt: str) -> str:
    values = [r[key] for r in rows]
    body = format(statistics.fmean(values), fmt)
    return body if len(values) == 1 else f"{body} [{format(min(values), fmt)}–{format(max(values), fmt)}]"


def curve(rows: list[dict], key: str) -> str:
    points = [statistics.fmean(r[key][q] for r in rows) for q in range(4)]
    return " / ".join(f"{p:.2f}" for p in points)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0, help="wall clock per run")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--bounds", default="1,4,8", help="async staleness bounds")
    parser.add_argument("--modes", default="decoupled,tis,none", help="--off-policy modes for the async runs")
    parser.add_argument("--digits", default="3,8", help="the task's digits (the demo's subset)")
    parser.add_argument("--batch-groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--env-median", type=float, default=0.3, help="median seconds in the environment")
    parser.add_argument("--env-sigma", type=float, default=1.0, help="log-normal sigma of the environment time")
    parser.add_argument(
        "--episode-timeout",
        type=float,
        default=60.0,
        help="an episode still running after this fails (bounds the drain)",
    )
    parser.add_argument("--no-sync", action="store_true", help="leave out the synchronous baseline")
    parser.add_argument("--server-extra", default="", help="more agentjet-server flags for every run (quoted)")
    parser.add_argument("--json", type=Path, help="write every run's figures here")
    args = parser.parse_args()
    from agentjet_server.embedded import ensure_embedded_model

    model_dir = ensure_embedded_model()
    plan: list[tuple[str, list[str], bool]] = []
    if not args.no_sync:
        plan.append(("sync", ["--max-staleness", "0", "--off-policy", "decoupled"], True))
    for bound in args.bounds.split(","):
        for mode in args.modes.split(","):
            extra = ["--max-staleness", bound, "--admission-batches", bound, "--off-policy", mode]
            plan.append((f"async, bound {bound}, {mode}", extra, False))
    seeds = [int(s) for s in args.seeds.split(",")]
    runs: list[dict] = []
    total = len(plan) * len(seeds)
    for seed in seeds:  # seeds outermost: a slow drift of the machine spreads over every configuration
        for name, extra, sync in plan:
            print(f"[{len(runs) + 1}/{total}] {name}, seed {seed} ...", flush=True, file=sys.stderr)
            run = one_run(model_dir, name, extra, sync, seed, args)
            print(
                f"    {run['steps']} steps, {run['episodes_per_s']:.1f} episodes/s, idle {run['idle']:.2f}, "
                f"lag {run['lag_mean']:.2f}, reward (last 20%) {run['reward_last20']:.3f}",
                flush=True,
                file=sys.stderr,
            )
            runs.append(run)
    n = min(run["episodes"] for run in runs)
    for run in runs:
        run["reward_first_n"] = statistics.fmean(run["rewards"][:n]) if n else math.nan
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))
    print(
        f"\n{len(seeds)} seeds x {args.seconds:g} s per run; digits {args.digits}; {args.batch_groups} groups x "
        f"{args.group_size} per step; concurrency {args.concurrency}; environment log-normal, median "
        f"{args.env_median:g} s, sigma {args.env_sigma:g}; {os.cpu_count()} CPUs; "
        f"server flags: {args.server_extra or '(defaults)'}\n"
    )
    print(
        "| configuration | learner steps/min | vs sync | learner idle | episodes/s | trained-token lag (mean / max) "
        "| IS weight mean / truncated | no-grad pass, share of step "
        f"| reward, last 20% | reward, first {n} episodes | reward by episode quarter | reward by wall-clock quarter |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|")
    by_name: dict[str, list[dict]] = {}
    for run in runs:
        by_name.setdefault(run["name"], []).append(run)
    sync_rate = mean(by_name["sync"], "steps_per_min") if "sync" in by_name else math.nan
    for name, rows in by_name.items():
        print(
            f"| {name} | {spread(rows, 'steps_per_min', '.1f')} | {mean(rows, 'steps_per_min') / sync_rate:.2f}x | "
            f"{mean(rows, 'idle'):.2f} | {mean(rows, 'episodes_per_s'):.1f} | {mean(rows, 'lag_mean'):.2f} / "
            f"{max(r['lag_max'] for r in rows)} | {mean(rows, 'is_weight'):.3f} / {mean(rows, 'is_truncated'):.4f} | "
            f"{mean(rows, 'prepare_share'):.2f} | {spread(rows, 'reward_last20', '.3f')} | "
            f"{spread(rows, 'reward_first_n', '.3f')} | "
            f"{curve(rows, 'reward_by_episodes')} | {curve(rows, 'reward_by_time')} |"
        )


if __name__ == "__main__":
    main()
