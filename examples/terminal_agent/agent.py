"""A terminal agent: the model reads a task's instruction and acts with three tools that run in the episode's
own sandbox (``bash``, ``read_file``, ``write_file``); the task's tests give the reward.

    agentjet-server up --port 8000 --model-size tools --lr 5e-4   # the embedded model that calls the listed tools
    agentjet-client run --code-dir examples/terminal_agent --server http://127.0.0.1:8000 --episodes 320

The tasks are the task directories of ``examples/terminal_tasks`` (Harbor's format: instruction, tests,
limits; docs/sandboxes.md). Each episode gets a fresh sandbox (bubblewrap: no network, a read-only system,
writable ``/app``), the model calls the tools as it likes for at most six turns, then ``tests/test.sh`` runs in
the same sandbox and its reward (0 or 1) is the episode's. Needs bubblewrap (``apt-get install bubblewrap``).
"""

import json

from agentjet_client import swarm_agent
from agentjet_client.sandbox import task_sandbox, verify

TURNS = 6
OUTPUT_CHARS = 800  # of a tool's output, what goes back to the model (the tools model reads 4,096 tokens)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command in /app and return its output.",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}},
                "required": ["command"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Return the text of a file.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "description": "Write text to a file.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                "required": ["path", "content"],
            },
        },
    },
]


async def run_tool(box, name: str, arguments: str) -> str:
    """A tool call's result as the model reads it (errors included: they are what it learns from)."""
    try:
        args = json.loads(arguments or "{}")
        if name == "bash":
            done = await box.exec(str(args["command"]), timeout=20)
            text = done.stdout + done.stderr + ("[timed out]" if done.timed_out else f"[exit {done.exit_code}]")
        elif name == "read_file":
            text = (await box.read_file(_inside(args["path"]))).decode(errors="replace")
        elif name == "write_file":
            await box.write_file(_inside(args["path"]), str(args["content"]))
            text = "written"
        else:
            text = f"error: no tool named {name}"
    except Exception as exc:  # a bad argument, a path outside /app: the model sees what went wrong
        text = f"error: {exc}"
    return text[-OUTPUT_CHARS:]


def _inside(path: object) -> str:
    text = str(path)
    return text if text.startswith("/") else f"/app/{text}"


@swarm_agent(tasks="../terminal_tasks")
async def terminal(task, episode):
    llm = episode.async_openai()
    messages = [
        {"role": "system", "content": "You work in a Linux terminal. Use the tools to do the task, then say done."},
        {"role": "user", "content": task["instruction"]},
    ]
    async with task_sandbox(task) as (box, terminal_task):
        for _ in range(TURNS):
            reply = await llm.chat.completions.create(
                model="agentjet-tiny", messages=messages, tools=TOOLS, max_tokens=64, temperature=1.0
            )
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))  # the answer goes back as it came
            if not message.tool_calls:
                break
            for call in message.tool_calls:
                result = await run_tool(box, call.function.name, call.function.arguments)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        return (await verify(box, terminal_task)).reward
