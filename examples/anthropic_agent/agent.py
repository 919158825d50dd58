"""An agent written for Claude: the Anthropic SDK's Messages API in the usual tool loop (``tools``,
``tool_use`` blocks, ``tool_result`` blocks), unchanged; the episode hands it a captured client.

    agentjet-server up --port 8000 --model-size tools --lr 5e-4   # the embedded model that calls the listed tools
    agentjet-client run --code-dir examples/anthropic_agent --server http://127.0.0.1:8000 --episodes 640

The server reads each request's content blocks as the chat conversation they are and answers in
the Messages API's shape, so every episode is trained as one timeline of exactly the sampled
tokens. Needs ``pip install 'agentjet-client[anthropic]'``.

Reward: 0.5 for calling ``add`` with the task's numbers, 0.5 for a final answer that contains the sum.
"""

from agentjet_client import swarm_agent

TOOLS = [
    {
        "name": "add",
        "description": "Add two integers.",
        "input_schema": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    }
]


def make_tasks() -> list[dict[str, object]]:
    pairs = [(2, 3), (4, 1), (3, 3), (1, 6), (5, 2), (2, 2)]
    return [{"id": f"add-{a}-{b}", "a": a, "b": b} for a, b in pairs]


def run_tool(name: str, arguments: dict) -> str:
    try:
        if name == "add":
            return str(int(arguments["a"]) + int(arguments["b"]))
        return f"error: no tool named {name}"
    except (ValueError, KeyError, TypeError) as exc:
        return f"error: {exc}"


@swarm_agent(tasks=make_tasks)
def claude_tools(task, episode):
    llm = episode.anthropic()
    a, b = task["a"], task["b"]
    messages = [{"role": "user", "content": f"What is {a} + {b}?"}]
    called_right, answer = False, ""
    for _ in range(4):
        reply = llm.messages.create(
            model="claude-for-this-agent",
            system="You are a careful assistant. Use the tools.",
            max_tokens=40,
            tools=TOOLS,
            messages=messages,
        )
        messages.append({"role": "assistant", "content": [block.model_dump() for block in reply.content]})
        if reply.stop_reason != "tool_use":
            answer = "".join(block.text for block in reply.content if block.type == "text")
            break
        results = []
        for block in reply.content:
            if block.type == "tool_use":
                result = run_tool(block.name, block.input)
                called_right = called_right or (block.name == "add" and result == str(a + b))
                results.append({"type": "tool_result", "tool_use_id": block.id, "content": result})
        messages.append({"role": "user", "content": results})
    return 0.5 * called_right + 0.5 * (str(a + b) in answer)
