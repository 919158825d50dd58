"""Your first task (docs/first-task.md): tasks from a JSONL file beside this file, a reward written by
hand, and a prompt in the shape the embedded tiny model answers (a digit after "Write ... as a digit.").

    agentjet-server up                                   # one shell
    agentjet-client run --code-dir examples/first_task --episodes 6000 --eval-every 10 --eval-episodes 50
"""

from agentjet_client import swarm_agent


# a task file is read from beside this file, wherever `run` is started
@swarm_agent(tasks="tasks.jsonl", eval_tasks="tasks.jsonl")
async def count_legs(task, episode):
    llm = episode.async_openai()
    reply = await llm.chat.completions.create(
        model="agentjet-tiny",
        messages=[{"role": "user", "content": f"Write the legs of a {task['animal']} as a digit."}],
        max_tokens=4,
        temperature=1.0,
    )
    answer = (reply.choices[0].message.content or "").strip()
    if answer == str(task["legs"]):
        return 1.0
    # a little for the right format: rewards in a group differ from the first step, so it has a gradient
    return 0.1 if answer.isdigit() else 0.0
