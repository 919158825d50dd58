"""A task with no checker, rewarded by an LLM judge that scores each GRPO group in one call.

The agent only answers; it never computes a reward. ``GroupJudge`` sends the task and the group's
answers to a judge endpoint, which ranks them against each other (as ART's RULER does); those scores
are the rewards. The judge is any OpenAI-compatible chat endpoint: set ``AGENTJET_JUDGE_URL`` (and
``AGENTJET_JUDGE_MODEL``, ``AGENTJET_JUDGE_API_KEY``). The figures in docs/judges.md come from the
rules-based stand-in beside this file, not from a judge model:

    python examples/judged/rules_judge.py --port 8100 &         # the stand-in judge
    agentjet-server up                                          # the model that learns
    agentjet-client run --code-dir examples/judged --episodes 4000
"""

import os

from agentjet_client import GroupJudge, swarm_agent

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
CHOSEN = os.environ.get("AGENTJET_DIGITS")
TASKS = [{"id": f"word-{d}", "word": WORDS[d]} for d in ([int(x) for x in CHOSEN.split(",")] if CHOSEN else range(10))]

judge = GroupJudge(
    os.environ.get("AGENTJET_JUDGE_URL", "http://127.0.0.1:8100/v1"),
    os.environ.get("AGENTJET_JUDGE_MODEL", "judge"),
    "The task asks for a number word written as one digit. Prefer the candidate that is exactly that digit; "
    "a single wrong digit is better than anything else.",
)


@swarm_agent(tasks=TASKS, eval_tasks=TASKS, reward=judge)
async def write_digit(task, episode):
    reply = await episode.async_openai().chat.completions.create(
        model="agentjet-tiny",
        messages=[{"role": "user", "content": f"Write {task['word']} as a digit."}],
        max_tokens=4,
        temperature=1.0,
    )
    return reply.choices[0].message.content or ""
