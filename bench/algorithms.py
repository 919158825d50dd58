"""GRPO against PPO (and any other server settings) on the demo task, side by side.

    python bench/algorithms.py [--episodes 26000] [--runs "grpo=" "ppo=--algorithm ppo"]

Each run is the demo (``scripts/dev.py demo``): a fresh server with the embedded model and its
defaults (10 groups x 16 episodes per step, lr 1e-3) plus the run's extra flags, and
``examples/digits`` driven by the runner with the demo's concurrency and seed. Reported per run:
mean reward over the first 10% and the last 20% of episodes (finishing order), the first episode
at which the mean of the preceding 1,000 reached 0.5 and 0.8, wall clock, policy versions, and the
final policy's accuracy on each prompt (32 samples each).
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


def one_run(model_dir: Path, extra: list[str], episodes: int) -> dict[str, float | int | None]:
    agent, version = load_agent(ROOT / "examples" / "digits")
    with served(model_dir, *extra) as url, SwarmClient(url) as client:
        last_print = [time.monotonic()]

        def progress(report: object) -> None:
            if time.monotonic() - last_print[0] > 15:
                last_print[0] = time.monotonic()
                rewards = report.rewards  # type: ignore[attr-defined]
                recent = statistics.fmean(rewards[-WINDOW:]) if rewards else 0.0
                print(f"    {len(rewards)} episodes, recent reward {recent:.3f}", file=sys.stderr, flush=True)

        config = RunConfig(episodes=episodes, group_size=16, concurrency=32, seed=0)
        started = time.monotonic()
        report = asyncio.run(Runner(client, agent, config, code_version=version, on_progress=progress).run())
        seconds = time.monotonic() - started
        versions = client.status().policy_version
        per_digit = final_accuracy(url)
    rewards = report.rewards
    return {
        "first10": report.mean(0.0, 0.1),
        "last20": report.mean(0.8, 1.0),
        "to05": reached(rewards, 0.5),
        "to08": reached(rewards, 0.8),
        "seconds": seconds,
        "versions": versions,
        "per_digit": per_digit,
    }


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=26000)
    parser.add_argument(
        "--runs", nargs="+", default=["grpo=", "ppo=--algorithm ppo"], help="NAME=SERVER FLAGS, one per run"
    )
    args = parser.parse_args()
    from agentjet_server.embedded import ensure_embedded_model

    model_dir = ensure_embedded_model()
    rows = []
    for spec in args.runs:
        name, _, flags = spec.partition("=")
        print(f"{name}: agentjet-server up {flags} ...", file=sys.stderr, flush=True)
        rows.append((name, flags, one_run(model_dir, shlex.split(flags), args.episodes)))
    print(f"\n{args.episodes} episodes per run, demo settings; first episode where the last {WINDOW} reach a mean")
    print(
        "| run | server flags | first 10% | last 20% | reaches 0.5 at | reaches 0.8 at | wall clock | versions "
        "| final accuracy per prompt (0..9) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    for name, flags, r in rows:
        to05 = f"{r['to05']:,}" if r["to05"] else "never"
        to08 = f"{r['to08']:,}" if r["to08"] else "never"
        print(
            f"| {name} | `{flags or '(defaults)'}` | {r['first10']:.3f} | {r['last20']:.3f} | {to05} | {to08} | "
            f"{r['seconds']:.0f} s | {r['versions']} | {r['per_digit']} |"
        )


if __name__ == "__main__":
    main()
