"""AgentJet against TRL's GRPOTrainer on the demo, side by side in one run.

    .venv/bin/python bench/peers.py [--episodes 26000] [--runs 1] [--env-median 0.2] [--json FILE]

Both train the same embedded tiny model directory on the same task and reward (the demo: ``Write seven as
a digit.`` -> ``7``, reward 1 for the right digit) with the same settings: groups of 16, 10 groups per
step, AdamW at lr 1e-3 (constant), clip 0.2 / 0.28, no KL, temperature 1, at most 4 completion tokens,
gradient norm clipped at 1, no activation checkpointing, fp32 on the CPU. AgentJet is ``agentjet-server
up`` (its defaults are these) and the digits agent run by the client library (32 episodes at once, as
``agentjet-client run``); TRL is ``GRPOTrainer`` in this process (its generate, then its step, one batch
of 160 at a time).

Two cases: the plain demo, and each episode followed by a log-normal environment latency (median
``--env-median`` s, sigma 1). For TRL the reward function of a batch waits for the slowest of its 160
environments, as a synchronous trainer with perfectly parallel environments would; AgentJet's client runs
160 episodes at once in that case (the same parallelism), and its server trains as they arrive: with its
default admission window (at least 2 batches' worth of episodes ahead of the learner, partial groups
included, widening while the learner waits for complete groups and the lag has room under the staleness
bound) and with ``--admission-batches 4`` (``agentjet+4``, a least of 4), which lets more groups wait on
their slowest episodes at the price of more policy lag (the lag of trained tokens, the trajectories refused
as stale and left out of batches as stale, and the window at the end are shown).

Reported per run: episodes per second, seconds and episodes until the mean reward over three consecutive
steps (160 episodes each, in finishing order) reaches 0.8, and the mean reward of the last 20% of
episodes; then the ratios ours / TRL. The figures move with anything else running on the machine (TRL's
two torch threads lose most of their speed when one core is busy): run it on an idle machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _server import served
from agentjet_client import RunConfig, Runner, SwarmClient, swarm_agent

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
GROUP, GROUPS = 16, 10
STEP = GROUP * GROUPS
TARGET = 0.8


@dataclass
class Result:
    """One trainer's run: each episode's (seconds since the start, reward), in finishing order."""

    name: str
    seconds: float
    episodes: list[tuple[float, float]] = field(default_factory=list)
    server: dict[str, float] = field(default_factory=dict)  # ours: the policy lag of what was trained

    def figures(self) -> dict[str, float | None]:
        rewards = [r for _, r in self.episodes]
        steps = [rewards[i : i + STEP] for i in range(0, len(rewards) - STEP + 1, STEP)]
        means = [sum(s) / len(s) for s in steps]
        reached = next((k for k in range(2, len(means)) if sum(means[k - 2 : k + 1]) / 3 >= TARGET), None)
        at = None if reached is None else (reached + 1) * STEP
        tail = rewards[int(len(rewards) * 0.8) :]
        return {
            "episodes_per_s": len(rewards) / self.seconds,
            "seconds_to_0.8": None if at is None else self.episodes[at - 1][0],
            "episodes_to_0.8": at,
            "last_20%": sum(tail) / max(1, len(tail)),
            "seconds": self.seconds,
            **self.server,
        }


def latency(rng: random.Random, median: float) -> float:
    return median * math.exp(rng.gauss(0.0, 1.0)) if median > 0 else 0.0


def ours(model_dir: Path, episodes: int, median: float, seed: int, *server_args: str) -> Result:
    rng = random.Random(seed)
    tasks = [{"id": f"digit-{d}", "word": w, "answer": str(d)} for d, w in enumerate(WORDS)]
    result = Result("agentjet", 0.0)
    start = [0.0]

    @swarm_agent(tasks=tasks)
    async def digits(task: dict[str, Any], episode: Any) -> float:
        reply = await episode.async_openai().chat.completions.create(
            model="agentjet-tiny",
            messages=[{"role": "user", "content": f"Write {task['word']} as a digit."}],
            max_tokens=4,
            temperature=1.0,
        )
        reward = 1.0 if (reply.choices[0].message.content or "").strip() == task["answer"] else 0.0
        if median:
            await asyncio.sleep(latency(rng, median))
        result.episodes.append((time.monotonic() - start[0], reward))
        return reward

    with served(model_dir, *server_args) as url, SwarmClient(url) as client:
        concurrency = STEP if median else 32
        config = RunConfig(episodes=episodes, group_size=GROUP, concurrency=concurrency, seed=seed)
        runner = Runner(client, digits, config, spool=None)
        start[0] = time.monotonic()
        asyncio.run(runner.run())
        result.seconds = time.monotonic() - start[0]
        status = client.status()
    lag = status.learner.trained_token_lag
    result.server = {
        "mean_token_lag": sum(int(k) * n for k, n in lag.items()) / max(1, sum(lag.values())),
        "refused_stale": status.trajectories.rejected_by_reason.get("stale", 0),
        "stale_at_training": status.learner.stale_at_training,
        "admission_window": getattr(status.learner, "admission_window", None) or 0.0,
    }
    return result


def trl(model_dir: Path, episodes: int, median: float, seed: int) -> Result:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    rng = random.Random(seed)
    order = random.Random(seed)
    rows = []
    for _ in range(episodes // STEP + 1):  # GROUPS prompts per step, each sampled GROUP times
        for d in order.choices(range(10), k=GROUPS):
            rows.append({"prompt": [{"role": "user", "content": f"Write {WORDS[d]} as a digit."}], "answer": str(d)})
    result = Result("trl", 0.0)
    start = [0.0]

    def reward(completions: list[Any], answer: list[str], **_: Any) -> list[float]:
        rewards = [1.0 if c[0]["content"].strip() == a else 0.0 for c, a in zip(completions, answer, strict=True)]
        if median:  # the batch waits for its slowest environment
            time.sleep(max(latency(rng, median) for _ in rewards))
        now = time.monotonic() - start[0]
        result.episodes.extend((now, r) for r in rewards)
        return rewards

    with tempfile.TemporaryDirectory(prefix="agentjet-trl-") as out:
        config = GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=STEP,
            num_generations=GROUP,
            max_completion_length=4,
            temperature=1.0,
            learning_rate=1e-3,
            lr_scheduler_type="constant",
            weight_decay=0.0,
            max_grad_norm=1.0,
            gradient_checkpointing=False,  # TRL turns it on by default; our learner does not checkpoint
            beta=0.0,
            epsilon=0.2,
            epsilon_high=0.28,
            max_steps=math.ceil(episodes / STEP),
            use_cpu=True,
            seed=seed,
            report_to=[],
            save_strategy="no",
            logging_steps=10**9,
            disable_tqdm=True,
            dataloader_num_workers=0,
            shuffle_dataset=False,
        )
        model = AutoModelForCausalLM.from_pretrained(str(model_dir))
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=reward,
            args=config,
            train_dataset=Dataset.from_list(rows),
            processing_class=tokenizer,
        )
        start[0] = time.monotonic()
        trainer.train()
        result.seconds = time.monotonic() - start[0]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=26000)
    parser.add_argument("--runs", type=int, default=1, help="runs of each trainer per case (seeds 0, 1, ...)")
    parser.add_argument("--env-median", type=float, default=0.2, help="the latency case's median seconds")
    parser.add_argument(
        "--latency-episodes", type=int, default=3200, help="episodes of the latency case (its speed, not its 0.8)"
    )
    parser.add_argument("--cases", default="plain,latency", help="plain, latency or both")
    parser.add_argument("--json", type=Path, help="write every run's figures here")
    parser.add_argument(
        "--trainers", default="trl,agentjet,agentjet+4", help="which to run: trl, agentjet, agentjet+4 (latency only)"
    )
    args = parser.parse_args()
    from agentjet_server.embedded import ensure_embedded_model

    model_dir = ensure_embedded_model()
    rows: dict[str, list[dict[str, Any]]] = {}
    for case in args.cases.split(","):
        median = args.env_median if case == "latency" else 0.0
        episodes = args.latency_episodes if case == "latency" else args.episodes
        trainers: list[tuple[str, Any, tuple[str, ...]]] = [("trl", trl, ()), ("agentjet", ours, ())]
        if case == "latency":
            trainers.append(("agentjet+4", ours, ("--admission-batches", "4")))
        trainers = [t for t in trainers if t[0] in args.trainers.split(",")]
        for run in range(args.runs):
            for name, fn, extra in trainers:
                print(f"{case}, run {run + 1}/{args.runs}: {name}, {episodes:,} episodes ...", flush=True)
                figures = fn(model_dir, episodes, median, run, *extra).figures()
                rows.setdefault(case, []).append({"trainer": name, "run": run, **figures})
                print(f"  {json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in figures.items()})}")
    print()
    for case, results in rows.items():
        print(f"{case}:")
        print(
            "| run | trainer | episodes/s | s to 0.8 | episodes to 0.8 | last 20% | mean token lag | refused stale "
            "| stale at training | window at the end |"
        )
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in results:
            s08 = "-" if r["seconds_to_0.8"] is None else f"{r['seconds_to_0.8']:.0f}"
            e08 = "-" if r["episodes_to_0.8"] is None else f"{r['episodes_to_0.8']:,}"
            lag = f"{r['mean_token_lag']:.2f}" if "mean_token_lag" in r else "0"
            print(
                f"| {r['run'] + 1} | {r['trainer']} | {r['episodes_per_s']:.1f} | {s08} | {e08} | {r['last_20%']:.3f} "
                f"| {lag} | {r.get('refused_stale', 0)} | {r.get('stale_at_training', 0)} "
                f"| {r.get('admission_window', 0.0):.1f} |"
            )
        for run in range(args.runs):
            pair = {r["trainer"]: r for r in results if r["run"] == run}
            for name in [n for n in pair if n != "trl" and "trl" in pair]:
                speed = pair[name]["episodes_per_s"] / pair["trl"]["episodes_per_s"]
                a, t = pair[name]["seconds_to_0.8"], pair["trl"]["seconds_to_0.8"]
                to08 = "-" if a is None or t is None else f"{a / t:.2f}"
                print(f"run {run + 1}: {name} / TRL episodes/s {speed:.2f}; time to 0.8 {to08}")
        print()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
