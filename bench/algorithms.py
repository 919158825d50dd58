"""Objectives side by side on the demo task: each policy loss and each advantage estimator, repeated.

    python bench/algorithms.py                         # every loss and estimator, 3 runs each, 12,000 episodes
    python bench/algorithms.py --runs 1 --settings "gspo=--policy-loss gspo" --episodes 6000

Each run is the demo (``scripts/dev.py demo``): a fresh server with the embedded model and its
defaults (10 groups x 16 episodes per step, lr 1e-3) plus the setting's flags, and ``examples/digits``
driven by the runner with the demo's concurrency; run ``i`` of a setting uses seed ``i``. Reported per
setting (runs side by side): mean reward over the first 10% and the last 20% of episodes (finishing
order), the first episode (and second) at which the mean of the preceding 1,000 reached 0.8, or the best
such mean where none did, the mean behaviour KL and sampler-trainer mismatch KL over the run's steps, and
the final policy's accuracy on each prompt (32 samples each).
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import statistics
import sys
import time
from pathlib import Path

from _server import served
from agentjet_client import RunConfig, Runner, SwarmClient
from agentjet_client.run.loader import load_agent

ROOT = Path(__file__).resolve().parent.parent
WINDOW = 1000


def reached(rewards: list[float], level: float) -> int | None:
    """The first episode count n >= WINDOW at which the mean of episodes n-WINDOW..n is >= level."""
    total = sum(rewards[:WINDOW])
    for n in range(WINDOW, len(rewards) + 1):
        if total / WINDOW >= level:
            return n
        if n < len(rewards):
            total += rewards[n] - rewards[n - WINDOW]
    return None


def one_run(model_dir: Path, extra: list[str], episodes: int, seed: int) -> dict[str, float | int | str | None]:
    agent, version = load_agent(ROOT / "examples" / "digits")
    started = time.monotonic()
    with served(model_dir, *extra) as url, SwarmClient(url) as client:
        last_print = [time.monotonic()]
        finished: list[tuple[int, float]] = []  # (episodes finished, seconds since the start), as they grow

        def progress(report: object) -> None:
            count = len(report.rewards)  # type: ignore[attr-defined]
            if not finished or finished[-1][0] != count:
                finished.append((count, time.monotonic() - started))
            if time.monotonic() - last_print[0] > 15:
                last_print[0] = time.monotonic()
                rewards = report.rewards  # type: ignore[attr-defined]
                recent = statistics.fmean(rewards[-WINDOW:]) if rewards else 0.0
                print(f"    {len(rewards)} episodes, recent reward {recent:.3f}", file=sys.stderr, flush=True)

        config = RunConfig(episodes=episodes, group_size=16, concurrency=32, seed=seed)
        started = time.monotonic()
        report = asyncio.run(Runner(client, agent, config, code_version=version, on_progress=progress).run())
        seconds = time.monotonic() - started
        versions = client.status().policy_version
        per_digit = final_accuracy(url)
        steps = step_lines(url)
    rewards = report.rewards
    to08 = reached(rewards, 0.8)
    return {
        "first10": report.mean(0.0, 0.1),
        "last20": report.mean(0.8, 1.0),
        "to05": reached(rewards, 0.5),
        "to08": to08,
        "seconds_to08": next((t for n, t in finished if n >= to08), None) if to08 else None,
        "best": best_window(rewards),
        "seconds": seconds,
        "versions": versions,
        "per_digit": per_digit,
        "behaviour_kl": mean_of(steps, "behaviour_kl"),
        "mismatch_kl": mean_of(steps, "mismatch_kl"),
    }


def best_window(rewards: list[float]) -> float:
    """The best mean of WINDOW consecutive episodes (of all of them, for a shorter run)."""
    if len(rewards) <= WINDOW:
        return statistics.fmean(rewards) if rewards else 0.0
    total = best = sum(rewards[:WINDOW])
    for n in range(WINDOW, len(rewards)):
        total += rewards[n] - rewards[n - WINDOW]
        best = max(best, total)
    return best / WINDOW


def step_lines(url: str) -> list[dict[str, object]]:
    """Every learner step's line of the server's history."""
    import httpx2

    lines: list[dict[str, object]] = []
    since = 0
    while True:
        body = httpx2.get(url + "/v1/metrics/history", params={"since": since, "kind": "step"}, timeout=60).json()
        lines += body["lines"]
        if not body["lines"] or body["last_seq"] <= since:
            return lines
        since = body["last_seq"]


def mean_of(steps: list[dict[str, object]], key: str) -> float | None:
    values = [float(s[key]) for s in steps if isinstance(s.get(key), int | float)]  # type: ignore[arg-type]
    return statistics.fmean(values) if values else None


def final_accuracy(url: str, samples: int = 32) -> str:
    """The final policy's accuracy on each of the ten prompts (``samples`` draws each, temperature 1)."""
    import httpx2

    words = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    out = []
    for digit, word in enumerate(words):
        answer = httpx2.post(
            url + "/v1/chat/completions",
            json={
                "model": "agentjet-tiny",
                "messages": [{"role": "user", "content": f"Write {word} as a digit."}],
                "max_tokens": 4,
                "temperature": 1.0,
                "n": samples,
            },
            timeout=120,
        ).json()
        right = sum((c["message"]["content"] or "").strip() == str(digit) for c in answer["choices"])
        out.append(f"{right / samples:.2f}")
    return " ".join(out)


# each policy loss (with the default estimator, grpo) and each estimator (with the default loss, ppo)
SETTINGS = [
    "ppo (default)=",
    "gspo=--policy-loss gspo --loss-aggregation seq-mean-token-mean --clip-low 0.0003 --clip-high 0.0004",
    "cispo=--policy-loss cispo",
    "sapo=--policy-loss sapo",
    "importance_sampling=--policy-loss importance_sampling",
    "dro=--policy-loss dro",
    "dr_grpo=--advantage dr_grpo --loss-aggregation seq-mean-token-sum-norm --loss-norm-length 4",
    "rloo=--advantage rloo",
    "reinforce_pp=--advantage reinforce_pp",
    "passk=--advantage passk",
    "gae (ppo)=--algorithm ppo",
]


def _cell(values: list[float | int | None], form: str) -> str:
    return " / ".join("never" if v is None else format(v, form) for v in values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=12000)
    parser.add_argument("--runs", type=int, default=3, help="runs of each setting (seeds 0, 1, ...)")
    parser.add_argument("--settings", nargs="+", default=SETTINGS, help="NAME=SERVER FLAGS, one per setting")
    args = parser.parse_args()
    from agentjet_server.embedded import ensure_embedded_model

    model_dir = ensure_embedded_model()
    rows = []
    for spec in args.settings:
        name, _, flags = spec.partition("=")
        runs = []
        for seed in range(args.runs):
            print(f"{name} (seed {seed}): agentjet-server up {flags} ...", file=sys.stderr, flush=True)
            runs.append(one_run(model_dir, shlex.split(flags), args.episodes, seed))
            print(f"    {runs[-1]}", file=sys.stderr, flush=True)
        rows.append((name, flags, runs))
    print(f"\n{args.episodes:,} episodes per run, {args.runs} runs per setting (seeds 0..), demo settings")
    print(
        "| setting | server flags | first 10% | last 20% | reaches 0.8 at (episodes) | seconds to 0.8 "
        "| best 1,000-episode mean | behaviour KL | mismatch KL |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, flags, runs in rows:
        cells = [
            _cell([r["first10"] for r in runs], ".3f"),  # type: ignore[misc]
            _cell([r["last20"] for r in runs], ".3f"),  # type: ignore[misc]
            _cell([r["to08"] for r in runs], ","),  # type: ignore[misc]
            _cell([r["seconds_to08"] for r in runs], ".0f"),  # type: ignore[misc]
            _cell([r["best"] for r in runs], ".3f"),  # type: ignore[misc]
            _cell([r["behaviour_kl"] for r in runs], ".2g"),  # type: ignore[misc]
            _cell([r["mismatch_kl"] for r in runs], ".2g"),  # type: ignore[misc]
        ]
        print(f"| {name} | `{flags or '(defaults)'}` | " + " | ".join(cells) + " |")
    print("\nfinal accuracy per prompt (0..9), each run:")
    for name, _, runs in rows:
        print(f"- {name}: " + "; ".join(str(r["per_digit"]) for r in runs))


if __name__ == "__main__":
    main()
