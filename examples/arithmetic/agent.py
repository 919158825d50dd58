"""Demo agent: answer ``What is A + B?`` (A + B <= 9) with one digit; reward 1 if right.

The embedded model was warmed up on the answer *format* with random digits, so it starts at
chance (about 0.1) and has to learn each sum from the reward alone. The prompt decides the
answer, so no fixed output can score well.

    agentjet-client run --code-dir examples/arithmetic --server http://127.0.0.1:8000 --episodes 1600
"""

from agentjet_client import swarm_agent


def make_tasks() -> list[dict[str, int | str]]:
    return [{"id": f"add-{a}-{b}", "a": a, "b": b} for a in range(10) for b in range(10) if a + b <= 9]


@swarm_agent(tasks=make_tasks)
async def solve(task, episode):
    llm = episode.async_openai()
    reply = await llm.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": f"What is {task['a']} + {task['b']}?"}],
        max_tokens=4,
        temperature=1.0,
    )
    answer = (reply.choices[0].message.content or "").strip()
    return 1.0 if answer == str(task["a"] + task["b"]) else 0.0
