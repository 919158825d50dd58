"""A stand-in for a judge model: an OpenAI-compatible chat endpoint that scores the candidates of the
AgentJet judge prompt by a fixed rule, deterministically. Use it to run the example (and the tests)
without a judge model; point ``AGENTJET_JUDGE_URL`` at a real one (``vllm serve``, a hosted API, an
``agentjet-server up --serve-only``) for real work.

    python examples/judged/rules_judge.py --port 8100 --rule digits

Rules:
- ``digits``: 1 for the digit the task's ``word`` names (or the conversation's "Write WORD as a digit."),
  0.2 for another single digit, 0 otherwise (the knowledge a judge model brings; the agent itself has no
  checker);
- ``length``: longer is better (each candidate's length over the longest), for tests of the ranking.

``GET /calls`` answers how many chat calls it has served.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import time

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def candidates_of(text: str) -> tuple[str, list[str]]:
    """The task and the candidates of the AgentJet judge prompt's user message."""
    head, *rest = re.split(r"\n\nCandidate \d+:\n", text)
    if rest:
        rest[-1] = rest[-1].rsplit("\n\nReply with", 1)[0]
    return head.removeprefix("Task:\n"), rest


def score(rule: str, task: str, candidate: str, longest: int) -> float:
    if rule == "length":
        return round(len(candidate) / max(1, longest), 4)
    try:
        shown = json.loads(task)
    except ValueError:
        shown = task
    word = shown.get("word") if isinstance(shown, dict) else None
    if word is None:  # a conversation (a gateway's session): the digit word its user asked for
        asked = re.search(r"Write (\w+) as a digit", task)
        word = asked.group(1) if asked else None
    answer = candidate.strip()
    if answer.startswith("[{"):  # a whole conversation: its final answer counts
        try:
            answer = str(json.loads(answer)[-1].get("content") or "").strip()
        except (ValueError, AttributeError, IndexError):
            pass
    if word in WORDS and answer == str(WORDS.index(word)):
        return 1.0
    return 0.2 if len(answer) == 1 and answer.isdigit() else 0.0


def make_app(rule: str, latency: float = 0.0) -> Starlette:
    served = {"calls": 0}

    async def chat(request: Request) -> JSONResponse:
        body = await request.json()
        if latency:  # what a judge model's answer takes (for benchmarks)
            await asyncio.sleep(latency)
        user = next(m["content"] for m in reversed(body["messages"]) if m["role"] == "user")
        task, candidates = candidates_of(user if isinstance(user, str) else json.dumps(user))
        if not candidates:
            return JSONResponse({"error": {"message": "no candidates in the prompt", "type": "invalid"}}, 400)
        longest = max(len(c) for c in candidates)
        scores = [score(rule, task, c, longest) for c in candidates]
        served["calls"] += 1
        text = json.dumps({"scores": scores})
        return JSONResponse(
            {
                "id": f"judge-{served['calls']}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body.get("model", "rules"),
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                "usage": {
                    "prompt_tokens": len(user.split()),
                    "completion_tokens": len(text.split()),
                    "total_tokens": len(user.split()) + len(text.split()),
                },
            }
        )

    async def calls(request: Request) -> JSONResponse:
        return JSONResponse(served)

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]), Route("/calls", calls)])


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--rule", choices=["digits", "length"], default="digits")
    parser.add_argument("--latency", type=float, default=0.0, help="seconds each answer takes (as a model's would)")
    args = parser.parse_args()
    uvicorn.run(make_app(args.rule, args.latency), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
