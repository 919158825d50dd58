"""Multi-turn tool use with the unmodified OpenAI SDK: the model may call ``add``, gets the result
back as a tool message, and answers; up to four calls per episode.

    agentjet-server up --port 8000 --model-size tools --lr 5e-4   # the embedded model that calls the listed tools
    agentjet-client run --code-dir examples/tool_use --server http://127.0.0.1:8000 --episodes 640

Reward: 0.5 for calling ``add`` with the task's numbers, 0.5 for a final answer that contains the
sum. Each call re-sends the whole conversation; the client names the call it continues, so the
server starts from the tokens the model sampled, and the learner trains each episode as one
timeline (see docs/guide.md, "Multi-turn episodes").
"""

import json

from agentjet_client import swarm_agent

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]


def make_tasks() -> list[dict[str, object]]:
    pairs = [(2, 3), (4, 1), (3, 3), (1, 6), (5, 2), (2, 2)]
    return [{"id": f"add-{a}-{b}", "a": a, "b": b} for a, b in pairs]


def run_tool(name: str, arguments: str) -> str:
    try:
        args = json.loads(arguments or "{}")
        if name == "add":
            return str(int(args["a"]) + int(args["b"]))
        return f"error: no tool named {name}"
    except (ValueError, KeyError, TypeError) as exc:
        return f"error: {exc}"


@swarm_agent(tasks=make_tasks)
def use_tools(task, episode):
    llm = episode.openai()
    a, b = task["a"], task["b"]
    messages = [
        {"role": "system", "content": "You are a careful assistant. Use the tools."},
        {"role": "user", "content": f"What is {a} + {b}?"},
    ]
    called_right, answer = False, ""
    for _ in range(4):
        reply = llm.chat.completions.create(
            model="agentjet-tiny", messages=messages, tools=TOOLS, max_tokens=40, temperature=1.0
        )
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))  # the answer goes back as it came
        if not message.tool_calls:
            answer = message.content or ""
            break
        for call in message.tool_calls:
            result = run_tool(call.function.name, call.function.arguments)
            if call.function.name == "add" and result == str(a + b):
                called_right = True
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return 0.5 * called_right + 0.5 * (str(a + b) in answer)
