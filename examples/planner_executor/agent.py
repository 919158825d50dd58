"""A team of two models on two servers: a planner decides what to do, an executor does it.

    agentjet-server up --port 8001                        # the planner's model (embedded, tiny)
    agentjet-server up --port 8002 --model-size small     # the executor's model (embedded, small)
    agentjet-client run --code-dir examples/planner_executor --server http://127.0.0.1:8001 \\
        --server executor=http://127.0.0.1:8002 --episodes 6400

The task is a number word. The planner reads ``Write seven as a digit.`` and decides which digit
the executor must produce; the executor is told ``Repeat the digit 7.`` and produces it. Each is
rewarded for its own part: the planner for choosing the right digit, the executor for doing what
it was told (whatever the plan). The team's result, the executor's digit against the answer, is
what both parts add up to. The agent's code names the model it was written for (``gpt-4o-mini``):
each agent's calls go to its own server whatever the name, so code written for a hosted model
trains unchanged. Each server trains only the turns its own model sampled.

Set ``AGENTJET_DIGITS`` (e.g. ``3,8``) to train on a subset of the words (the end-to-end test does).
"""

import os

from agentjet_client import swarm_agent

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def make_tasks() -> list[dict[str, object]]:
    chosen = os.environ.get("AGENTJET_DIGITS")
    digits = [int(d) for d in chosen.split(",")] if chosen else range(10)
    return [{"id": f"word-{d}", "word": WORDS[d], "answer": str(d)} for d in digits]


async def ask(llm, content: str, max_tokens: int = 4) -> str:
    reply = await llm.chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": content}], max_tokens=max_tokens, temperature=1.0
    )
    return (reply.choices[0].message.content or "").strip()


@swarm_agent(tasks=make_tasks)
async def plan_and_execute(task, episode):
    plan = await ask(episode.async_openai(agent="planner"), f"Write {task['word']} as a digit.")
    if not (len(plan) == 1 and plan.isdigit()):  # an unusable plan: the executor has nothing to do
        return {"planner": 0.0, "executor": 0.0}
    # the executor's part is one digit: it answers with one token. (Asked for more, a tiny model is
    # also trained on the end token after its wrong digits, and can unlearn ending its answer.)
    done = await ask(episode.async_openai(agent="executor"), f"Repeat the digit {plan}.", max_tokens=1)
    return {"planner": float(plan == task["answer"]), "executor": float(done == plan)}
