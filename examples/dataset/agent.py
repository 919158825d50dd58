"""Tasks from a JSONL file with a held-out part: the evaluation rounds play tasks that are never trained.

``tasks.jsonl`` beside this file holds 20 tasks (ten number words, each also in capitals).
``eval_tasks=0.2`` holds out about a fifth of them, chosen by a hash of each task's id: the same tasks
on every machine and in every run, and none of them is ever trained (the server records evaluation
episodes by policy version and never trains them). The evaluation rounds measure how the policy does
on tasks it never trained on.

    agentjet-client run --code-dir examples/dataset --episodes 6000 --eval-every 10 --epochs 100
"""

from agentjet_client import swarm_agent


@swarm_agent(tasks="tasks.jsonl", eval_tasks=0.2)
async def answer(task, episode):
    reply = await episode.async_openai().chat.completions.create(
        model="agentjet-tiny",
        messages=[{"role": "user", "content": task["prompt"]}],
        max_tokens=4,
        temperature=1.0,
    )
    return 1.0 if (reply.choices[0].message.content or "").strip() == task["answer"] else 0.0
