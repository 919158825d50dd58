"""Rewards from a plain function, a per-episode LLM judge and a group judge, side by side, same task.

    python bench/judges.py [--episodes 800] [--group-size 8] [--judge-latency 0.5] [--concurrency 16]

One real server (embedded model) and the stand-in judge endpoint of ``examples/judged`` answering each
call after ``--judge-latency`` seconds (what a judge model's answer takes). The task is the judged
example's (a number word written as a digit, words 3 and 8); the three runs differ only in the reward:

  function    the rule itself as a reward function (``reward=fn``): no judge
  judge       ``Judge``: one call per episode (at most 8 at once, the judge's default)
  group       ``GroupJudge``: one call per GRPO group

The judges run without their answer cache (``cache=False``): the tiny model's answers repeat (a few
digits), so a cached judge would answer most episodes from the spool, which real answers rarely allow.

Reported: episodes per second (from the first start to the last episode answered by the server, judge
time included), the ratio to the function's, and judge calls per episode.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx2

from _server import served
from agentjet_client import GroupJudge, Judge, RunConfig, Runner, SwarmClient, swarm_agent

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "packages" / "agentjet-server" / "src" / "agentjet_server" / "embedded" / "models" / "agentjet-tiny"
WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
TASKS = [{"id": f"word-{d}", "word": WORDS[d]} for d in (3, 8)]
PROMPT = "The task asks for a number word written as one digit. Prefer the candidate that is exactly that digit."


def rule(task, result):
    answer = result.strip()
    if answer == str(WORDS.index(task["word"])):
        return 1.0
    return 0.2 if len(answer) == 1 and answer.isdigit() else 0.0


def agent_with(reward):
    @swarm_agent(tasks=TASKS, reward=reward)
    async def write_digit(task, episode):
        reply = await episode.async_openai().chat.completions.create(
            model="agentjet-tiny",
            messages=[{"role": "user", "content": f"Write {task['word']} as a digit."}],
            max_tokens=4,
            temperature=1.0,
        )
        return reply.choices[0].message.content or ""

    return write_digit


def judge_endpoint(port: int, latency: float) -> subprocess.Popen[bytes]:
    script = ROOT / "examples" / "judged" / "rules_judge.py"
    command = [sys.executable, str(script), "--port", str(port), "--latency", str(latency)]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(300):
        try:
            httpx2.get(f"http://127.0.0.1:{port}/calls", timeout=2)
            return proc
        except httpx2.HTTPError:
            time.sleep(0.1)
    raise SystemExit("the judge endpoint did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=800)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--judge-latency", type=float, default=0.5)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    port = 18100 + os.getpid() % 1000
    judge_url = f"http://127.0.0.1:{port}/v1"
    endpoint = judge_endpoint(port, args.judge_latency)
    rows = []
    try:
        for name, reward in (
            ("function", rule),
            ("judge", Judge(judge_url, "rules", PROMPT, cache=False)),
            ("group", GroupJudge(judge_url, "rules", PROMPT, cache=False)),
        ):
            batch = ["--batch-groups", "2", "--group-size", str(args.group_size), "--max-staleness", "16"]
            with served(MODEL, *batch) as url, SwarmClient(url) as client:
                before = httpx2.get(f"http://127.0.0.1:{port}/calls").json()["calls"]
                config = RunConfig(
                    episodes=args.episodes, group_size=args.group_size, concurrency=args.concurrency, seed=0
                )
                started = time.monotonic()
                report = asyncio.run(Runner(client, agent_with(reward), config).run())
                seconds = time.monotonic() - started
                calls = httpx2.get(f"http://127.0.0.1:{port}/calls").json()["calls"] - before
            assert report.accepted == report.finished == args.episodes, report
            mean = sum(report.rewards) / len(report.rewards)
            rows.append((name, report.finished / seconds, calls / report.finished, mean, seconds))
            print(f"{name}: {report.finished} episodes in {seconds:.1f}s", flush=True)
    finally:
        endpoint.kill()
    base = rows[0][1]
    print(f"\n{args.episodes} episodes, groups of {args.group_size}, judge answers after {args.judge_latency}s")
    print(f"{'reward':<10} {'episodes/s':>11} {'vs function':>12} {'judge calls/episode':>20} {'mean reward':>12}")
    for name, rate, calls, mean, _ in rows:
        print(f"{name:<10} {rate:>11.1f} {rate / base:>11.2f}x {calls:>20.3f} {mean:>12.3f}")


if __name__ == "__main__":
    main()
