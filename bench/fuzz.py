"""Thousands of generated hostile bodies against a real ``agentjet-server up`` process; prints counts.

The same strategies as ``tests/server/test_fuzz.py`` (``tests/fuzz_requests.py``), many more
cases, and the named cases of the review once each. Counts answers by status, and the failures:
responses >= 500, dropped connections, malformed errors, streams that did not end with [DONE].
Run:

    .venv/bin/python bench/fuzz.py [--examples 2000]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx2
from hypothesis import HealthCheck, given, settings

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: tests.fuzz_requests

from tests.fuzz_requests import CHAT, CHAT_BODIES, NAMED_CASES, TRAJECTORIES, TRAJECTORY_BODIES, check_answer

from _server import served
from agentjet_server.embedded import ensure_embedded_model


def fuzz_endpoint(path: str, strategy: Any, examples: int, one: Callable[[str, bytes], None]) -> None:
    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(body=strategy)
    def fuzz(body: bytes) -> None:
        one(path, body)

    fuzz()


def run(url: str, examples: int) -> tuple[Counter[str], list[str]]:
    counts: Counter[str] = Counter()
    failures: list[str] = []
    started = time.monotonic()
    with httpx2.Client(base_url=url, timeout=120) as client:

        def one(path: str, body: bytes) -> None:
            try:
                status, _ = check_answer(client, path, body)
                counts[f"{path} {status}"] += 1
            except AssertionError as exc:
                counts[f"{path} FAILED"] += 1
                failures.append(str(exc)[:300])
            except httpx2.HTTPError as exc:
                counts[f"{path} dropped"] += 1
                failures.append(f"dropped connection: {type(exc).__name__} for {body[:200]!r}")
            done = sum(counts.values())
            if done % 250 == 0:
                print(f"  {done} requests, {time.monotonic() - started:.0f}s", flush=True)

        for case in NAMED_CASES:
            one(case.path, case.body)
        for path, strategy in ((CHAT, CHAT_BODIES), (TRAJECTORIES, TRAJECTORY_BODIES)):
            fuzz_endpoint(path, strategy, examples, one)
    return counts, failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=2000, help="generated bodies per endpoint")
    args = parser.parse_args()
    model = ensure_embedded_model()
    with served(model) as url:
        started = time.monotonic()
        counts, failures = run(url, args.examples)
        seconds = time.monotonic() - started
    total = sum(counts.values())
    bad = sum(n for key, n in counts.items() if key.endswith(("FAILED", "dropped")))
    print(
        f"\n{total} requests in {seconds:.0f}s ({len(NAMED_CASES)} named cases, {args.examples} generated per endpoint)"
    )
    print(f"{'endpoint':24s} {'answer':>8s} {'count':>7s}")
    for key in sorted(counts):
        path, answer = key.split(" ")
        print(f"{path:24s} {answer:>8s} {counts[key]:7d}")
    print(f"5xx, dropped connections, malformed errors or unfinished streams: {bad}")
    for failure in failures[:10]:
        print("  ", failure)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
