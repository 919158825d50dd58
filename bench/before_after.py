"""Chat latency, and the learner's step, of this checkout against an earlier commit's, side by side in one run.

Both servers run the same shipped tiny model on this machine at once; the same greedy request is sent to
each in alternating blocks, so that drift of the machine falls on both alike. The earlier commit is checked
out into a temporary git worktree and run from its sources (``PYTHONPATH``) in this environment. With
``--learner-steps N``, each checkout's ``Learner.step`` is then timed on the same batch (GRPO groups of the
embedded model's own answers, built from fixed tokens), in alternating processes. Run:

    .venv/bin/python bench/before_after.py --base 0e29d8e [--requests 400] [--block 20] [--learner-steps 40]

Prints p50/p99 of both and the ratio now / before (a refactoring should keep it within 1.05).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
from pathlib import Path

import httpx2

from _server import served
from latency import MAX_TOKENS, MESSAGES, pct, timed

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the commit to compare with (any git revision)")
    parser.add_argument("--requests", type=int, default=400, help="requests to each server")
    parser.add_argument("--block", type=int, default=20, help="requests in a row to one server")
    parser.add_argument("--learner-steps", type=int, default=0, help="also time this many learner steps of each")
    args = parser.parse_args()
    from agentjet_server.embedded import ensure_embedded_model

    model_dir = ensure_embedded_model()
    body = {"model": "agentjet-tiny", "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0.0}
    runs: dict[str, list[float]] = {"before": [], "now": []}
    with tempfile.TemporaryDirectory(prefix="agentjet-base-") as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(base), args.base], check=True)
        try:
            print(f"servers: {args.base} and this checkout, same model ...", flush=True)
            with served(model_dir, sources=base) as before, served(model_dir, sources=ROOT) as now:
                with httpx2.Client() as http:
                    urls = {"before": before, "now": now}
                    for url in urls.values():  # warm both
                        for _ in range(10):
                            http.post(url + "/v1/chat/completions", json=body).raise_for_status()
                    while len(runs["now"]) < args.requests:
                        for name, url in urls.items():
                            runs[name] += timed(
                                lambda u=url: http.post(u + "/v1/chat/completions", json=body).raise_for_status(),
                                args.block,
                                warm=0,
                            )
                        print(f"  {len(runs['now'])}/{args.requests} requests each", flush=True)
            if args.learner_steps:
                steps = learner_steps(model_dir, {"before": base, "now": ROOT}, args.learner_steps)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False)
    p50 = {name: statistics.median(values) for name, values in runs.items()}  # timed: milliseconds
    p99 = {name: pct(values, 0.99) for name, values in runs.items()}
    print("\n| server | p50 ms | p99 ms |\n|---|---:|---:|")
    for name in runs:
        print(f"| {args.base if name == 'before' else 'this checkout'} | {p50[name]:.2f} | {p99[name]:.2f} |")
    print(f"\np50 now / before: {p50['now'] / p50['before']:.3f}; p99: {p99['now'] / p99['before']:.3f}")
    if args.learner_steps:
        median = {name: statistics.median(values) for name, values in steps.items()}
        print(
            f"\nlearner step, median of {args.learner_steps} each: before {median['before']:.1f} ms, now "
            f"{median['now']:.1f} ms; now / before {median['now'] / median['before']:.3f}"
        )


STEPS = """
import json, sys, time
import torch
from transformers import AutoModelForCausalLM
from agentjet_client.protocol import Trajectory, Turn
from agentjet_server.learner.batch import build_batch
from agentjet_server.learner.trainer import Learner, LearnerConfig

model_dir, count = sys.argv[1], int(sys.argv[2])
torch.manual_seed(0)
model = AutoModelForCausalLM.from_pretrained(model_dir)
learner = Learner(model, LearnerConfig(lr=1e-4), pad_id=0)
groups = []
for g in range(4):  # four groups of eight, a shared prompt each, answers of 6 tokens
    prompt = [10 + g, *range(20, 60)]
    group = []
    for i in range(8):
        turn = Turn(policy_version=0, prompt_token_ids=prompt, completion_token_ids=[70 + i, 71, 72, 73, 74, 2],
                    completion_logprobs=[-1.0] * 6, finish_reason="stop")
        group.append(Trajectory(id=f"{g}-{i}", task_id=f"t{g}", turns=[turn], reward=float(i % 2)))
    groups.append(group)
for _ in range(3):
    learner.step(build_batch(groups, version=0))
times = []
for _ in range(count):
    batch = build_batch(groups, version=0)
    started = time.perf_counter()
    learner.step(batch)
    times.append((time.perf_counter() - started) * 1000)
print(json.dumps(times))
"""


def learner_steps(model_dir: Path, checkouts: dict[str, Path], count: int, rounds: int = 4) -> dict[str, list[float]]:
    """Milliseconds of each of ``count`` learner steps per checkout, in ``rounds`` alternating processes."""
    import json
    import os
    import sys

    out: dict[str, list[float]] = {name: [] for name in checkouts}
    per_round = max(1, count // rounds)
    for round_ in range(rounds):
        for name, sources in checkouts.items():
            paths = [str(sources / "packages" / p / "src") for p in ("agentjet-server", "agentjet-client")]
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
            done = subprocess.run(
                [sys.executable, "-c", STEPS, str(model_dir), str(per_round)],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
            out[name] += json.loads(done.stdout.strip().splitlines()[-1])
        print(f"  learner steps: round {round_ + 1}/{rounds}", flush=True)
    return out


if __name__ == "__main__":
    main()
