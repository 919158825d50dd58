"""Demo agent: ``Write seven as a digit.`` -> ``7``; reward 1 for the right digit, else 0.

The embedded model was warmed up on the answer *format* with random digits as targets, so it
starts at chance (about 0.1) and learns each answer from the reward alone. The prompt decides
the answer, so no fixed output can score well.

    agentjet-client run --code-dir examples/digits --server http://127.0.0.1:8000 --episodes 26000

Set ``AGENTJET_DIGITS`` (e.g. ``3,8``) to train on a subset of the words (the end-to-end test
does, to stay short).

Evaluation (``--eval-every N`` or ``agentjet-client eval``) runs the same ten prompts as episodes the
server records by policy version and never trains: with ten prompts there is nothing to hold out,
so it measures the policy itself, apart from the exploration noise of the training rewards.
"""

import os

from agentjet_client import swarm_agent

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def make_tasks() -> list[dict[str, object]]:
    chosen = os.environ.get("AGENTJET_DIGITS")
    digits = [int(d) for d in chosen.split(",")] if chosen else range(10)
    return [{"id": f"digit-{d}", "word": WORDS[d], "answer": str(d)} for d in digits]


@swarm_agent(tasks=make_tasks, eval_tasks=make_tasks)
async def write_digit(task, episode):
    llm = episode.async_openai()
    reply = await llm.chat.completions.create(
        model="agentjet-tiny",
        messages=[{"role": "user", "content": f"Write {task['word']} as a digit."}],
        max_tokens=4,
        temperature=1.0,
    )
    answer = (reply.choices[0].message.content or "").strip()
    return 1.0 if answer == task["answer"] else 0.0
