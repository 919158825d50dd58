"""Two agents in one episode, calling the model at the same time: a solver and a checker.

    agentjet-client run --code-dir examples/multi_agent --server http://127.0.0.1:8000 --episodes 640

Each agent gets its own model handle (``episode.async_openai(agent=...)``); their calls are captured
as separate timelines of the episode. The agent returns one reward per agent: the solver is rewarded
for the right digit, the checker for judging the solver's first answer correctly. The learner
normalises each agent's reward among the same agent of the episode's GRPO siblings.
"""

import asyncio

from agentjet_client import swarm_agent

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def make_tasks() -> list[dict[str, object]]:
    return [{"id": f"digit-{d}", "word": WORDS[d], "answer": str(d)} for d in (3, 8)]


async def ask(llm, content: str) -> str:
    reply = await llm.chat.completions.create(
        model="agentjet-tiny", messages=[{"role": "user", "content": content}], max_tokens=4, temperature=1.0
    )
    return (reply.choices[0].message.content or "").strip()


@swarm_agent(tasks=make_tasks)
async def solve_and_check(task, episode):
    solver, checker = episode.async_openai(agent="solver"), episode.async_openai(agent="checker")
    question = f"Write {task['word']} as a digit."
    # both agents work at once: two solver attempts and the checker's own answer
    first, second, own = await asyncio.gather(ask(solver, question), ask(solver, question), ask(checker, question))
    verdict = await ask(checker, f"Write {task['word']} as a digit. Someone wrote {first}.")
    solver_reward = (float(first == task["answer"]) + float(second == task["answer"])) / 2
    checker_reward = float((own == task["answer"]) and (verdict == task["answer"]))
    return {"solver": solver_reward, "checker": checker_reward}
