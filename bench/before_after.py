"""Chat latency of this checkout's server against an earlier commit's, side by side in one run.

Both servers run the same shipped tiny model on this machine at once; the same greedy request is sent to
each in alternating blocks, so that drift of the machine falls on both alike. The earlier commit is checked
out into a temporary git worktree and run from its sources (``PYTHONPATH``) in this environment. Run:

    .venv/bin/python bench/before_after.py --base 0e29d8e [--requests 400] [--block 20]

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
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False)
    p50 = {name: statistics.median(values) for name, values in runs.items()}  # timed: milliseconds
    p99 = {name: pct(values, 0.99) for name, values in runs.items()}
    print("\n| server | p50 ms | p99 ms |\n|---|---:|---:|")
    for name in runs:
        print(f"| {args.base if name == 'before' else 'this checkout'} | {p50[name]:.2f} | {p99[name]:.2f} |")
    print(f"\np50 now / before: {p50['now'] / p50['before']:.3f}; p99: {p99['now'] / p99['before']:.3f}")


if __name__ == "__main__":
    main()
