"""The online digits example, timed: from chance to ``--target`` through the gateway alone.

Each run starts a fresh ``agentjet-server up`` (the embedded model, all ten digits unless
``AGENTJET_DIGITS`` says otherwise), an ``agentjet-client gateway`` in front of it and
``examples/online_digits/users.py`` with its own seed; the users' feedback arrives 0 to ``--max-delay``
seconds after each answer. Reported per run: the seconds and sessions until the users' success rate
(their last 1,000 answers) first reached the target, the server's accepted/rejected/trained counts and
its policy version then, and the gateway's counts.

    .venv/bin/python bench/online.py [--runs 3] [--max-delay 30] [--concurrency 64]
                                     [--max-staleness 64] [--batch-groups 40]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx2

from _server import served
from gateway import gateway_process

ROOT = Path(__file__).resolve().parents[1]


def one_run(args: argparse.Namespace, seed: int, model_dir: Path) -> dict[str, Any]:
    extra = ["--max-staleness", str(args.max_staleness), "--batch-groups", str(args.batch_groups), "--seed", str(seed)]
    with served(model_dir, *extra) as server, tempfile.TemporaryDirectory() as spool:
        proc, gateway = gateway_process(server, Path(spool))
        try:
            users = [
                sys.executable,
                str(ROOT / "examples" / "online_digits" / "users.py"),
                "--gateway",
                gateway,
                "--sessions",
                str(args.sessions),
                "--concurrency",
                str(args.concurrency),
                "--max-delay",
                str(args.max_delay),
                "--target",
                str(args.target),
                "--seed",
                str(seed),
                "--until-target",
            ]
            lines: list[str] = []
            with subprocess.Popen(users, stdout=subprocess.PIPE, text=True, env={**os.environ}) as run:
                assert run.stdout is not None
                for line in run.stdout:
                    print(f"  [seed {seed}] {line.rstrip()}", flush=True)
                    lines.append(line)
            status = httpx2.get(server + "/v1/status").json()
            counts = httpx2.get(gateway + "/v1/gateway/status").json()["counts"]
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    reached = next((re.search(r"after (\d+) sessions, (\d+) s", line) for line in lines if ">=" in line), None)
    return {
        "seed": seed,
        "reached": reached is not None,
        "sessions": int(reached.group(1)) if reached else None,
        "seconds": int(reached.group(2)) if reached else None,
        "server": status["trajectories"],
        "version": status["policy_version"],
        "gateway": counts,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--sessions", type=int, default=150000, help="most sessions a run may take")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-delay", type=float, default=30.0)
    parser.add_argument("--target", type=float, default=0.8)
    parser.add_argument("--max-staleness", type=int, default=64)
    parser.add_argument("--batch-groups", type=int, default=40, help="the server's groups per update")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    from agentjet_server.embedded import ensure_embedded_model

    model_dir = ensure_embedded_model()
    results = []
    for seed in range(args.runs):
        print(f"run {seed} ...", flush=True)
        results.append(one_run(args, seed, model_dir))
    print()
    print("| run | reached | seconds | sessions | server accepted / rejected (stale) / trained | gateway expired |")
    print("|---:|---|---:|---:|---|---:|")
    for r in results:
        s = r["server"]
        stale = s["rejected_by_reason"].get("stale", 0)
        print(
            f"| {r['seed']} | {'yes' if r['reached'] else 'no'} | {r['seconds'] or '-'} | {r['sessions'] or '-'} | "
            f"{s['accepted']} / {s['rejected']} ({stale}) / {s['trained']} | {r['gateway']['expired']} |"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
