"""Scripted users of a deployed agent, training it through `agentjet-client gateway` alone.

Each user opens a session, asks the deployed model "Write seven as a digit." (a digit word at random),
reads the answer, and gives feedback 0-30 s later: reward 1 when the answer is the digit, else 0.
Nothing here knows about training: the gateway captures the calls and the feedback trains them.

    agentjet-server up --port 8000 --max-staleness 64 --batch-groups 40
    agentjet-client gateway --server http://127.0.0.1:8000 --port 8100
    python examples/online_digits/users.py --gateway http://127.0.0.1:8100 --sessions 100000

Feedback 0-30 s late is 20-40 policy versions late at the server's default 10 groups per update, and
the policy then swings (up to 0.7 and back to 0); 40 groups per update keep it to a handful of versions
and it climbs steadily (docs/online.md, "Late rewards and staleness"). It prints the users' success rate
(the last 1,000 answers they saw) every few seconds, and when it first reaches ``--target``
(``--until-target`` stops there). Set ``AGENTJET_DIGITS`` (e.g. ``3,8``) to ask for some digits only.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time
import uuid
from collections import deque

import httpx2 as httpx

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


class Users:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        chosen = os.environ.get("AGENTJET_DIGITS")
        self.digits = [int(d) for d in chosen.split(",")] if chosen else list(range(10))
        self.rng = random.Random(args.seed)
        self.recent: deque[float] = deque(maxlen=1000)
        self.asked = self.rewarded = self.refused = 0
        self.reached: float | None = None
        self.started = time.monotonic()
        self.feedback: set[asyncio.Task[None]] = set()

    async def session(self, http: httpx.AsyncClient) -> None:
        digit = self.rng.choice(self.digits)
        session = f"user-{uuid.uuid4().hex[:12]}"
        reply = await http.post(
            "/v1/chat/completions",
            json={
                "model": "agentjet-tiny",
                "messages": [{"role": "user", "content": f"Write {WORDS[digit]} as a digit."}],
                "max_tokens": 4,
            },
            headers={"X-AgentJet-Session": session},
        )
        if reply.status_code != 200:  # the gateway says why (a 503 while the server restarts): try later
            await asyncio.sleep(1.0)
            return
        answer = (reply.json()["choices"][0]["message"]["content"] or "").strip()
        reward = 1.0 if answer == str(digit) else 0.0
        self.asked += 1
        self.recent.append(reward)
        rate = sum(self.recent) / len(self.recent)
        if self.reached is None and len(self.recent) == self.recent.maxlen and rate >= self.args.target:
            self.reached = time.monotonic() - self.started
            done = f"after {self.asked} sessions, {self.reached:.0f} s"
            print(f"users' success rate {rate:.2f} >= {self.args.target} {done}", flush=True)
        job = asyncio.create_task(self.give_feedback(http, session, reward))
        self.feedback.add(job)
        job.add_done_callback(self.feedback.discard)

    async def give_feedback(self, http: httpx.AsyncClient, session: str, reward: float) -> None:
        await asyncio.sleep(self.rng.uniform(0, self.args.max_delay))
        for _ in range(30):
            try:
                answer = await http.post("/v1/feedback", json={"session": session, "reward": reward})
            except httpx.TransportError:
                await asyncio.sleep(1.0)
                continue
            if answer.status_code == 200:
                self.rewarded += 1
            else:
                self.refused += 1
            return

    async def run(self) -> None:
        limits = httpx.Limits(max_connections=self.args.concurrency + 64)
        async with httpx.AsyncClient(base_url=self.args.gateway, timeout=120, limits=limits) as http:
            reporter = asyncio.create_task(self.report())
            slots = asyncio.Semaphore(self.args.concurrency)

            async def one() -> None:
                async with slots:
                    try:
                        await self.session(http)
                    except httpx.TransportError:
                        await asyncio.sleep(1.0)

            pending: set[asyncio.Task[None]] = set()
            for _ in range(self.args.sessions):
                if self.reached is not None and self.args.until_target:
                    break
                await slots.acquire()
                slots.release()
                job = asyncio.create_task(one())
                pending.add(job)
                job.add_done_callback(pending.discard)
                await asyncio.sleep(0)
            await asyncio.gather(*pending)
            await asyncio.gather(*self.feedback)
            reporter.cancel()
        self.line()

    def line(self) -> None:
        rate = sum(self.recent) / len(self.recent) if self.recent else 0.0
        print(
            f"{time.monotonic() - self.started:6.0f} s  sessions {self.asked}  success (last {len(self.recent)}) "
            f"{rate:.2f}  feedback given {self.rewarded}, waiting {len(self.feedback)}, refused {self.refused}",
            flush=True,
        )

    async def report(self) -> None:
        while True:
            await asyncio.sleep(self.args.every)
            self.line()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gateway", default="http://127.0.0.1:8100")
    parser.add_argument("--sessions", type=int, default=100000, help="sessions in all")
    parser.add_argument("--concurrency", type=int, default=64, help="calls in flight at once")
    parser.add_argument("--max-delay", type=float, default=30.0, help="feedback arrives 0..this many seconds later")
    parser.add_argument("--target", type=float, default=0.8, help="report when the success rate first reaches it")
    parser.add_argument("--until-target", action="store_true", help="open no more sessions once it is reached")
    parser.add_argument("--every", type=float, default=10.0, help="seconds between progress lines")
    parser.add_argument("--seed", type=int, default=0)
    asyncio.run(Users(parser.parse_args()).run())


if __name__ == "__main__":
    main()
