"""A LangChain tool-calling agent, unchanged except for where its model comes from.

    pip install 'agentjet-client[langchain]'
    agentjet-server up --port 8000 --model-size tools --lr 5e-4   # the embedded model that calls the listed tools
    agentjet-client run --code-dir examples/langchain_agent --server http://127.0.0.1:8000 --episodes 640

``episode.langchain()`` is a ``ChatOpenAI`` pointed at the episode's capture proxy: ``bind_tools``,
``ainvoke`` and the message types are LangChain's own. The loop below is the usual tool-calling
loop: ask, run the tools the model calls, send the results back as ``ToolMessage``s, repeat.
Reward: 0.5 for calling ``add`` with the task's numbers, 0.5 for a final answer containing the sum.
"""

from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool

from agentjet_client import swarm_agent


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def make_tasks() -> list[dict[str, object]]:
    pairs = [(2, 3), (4, 1), (3, 3), (1, 6)]
    return [{"id": f"add-{a}-{b}", "a": a, "b": b} for a, b in pairs]


@swarm_agent(tasks=make_tasks)
async def langchain_adder(task, episode):
    llm = episode.langchain(max_tokens=40, temperature=1.0).bind_tools([add])
    a, b = task["a"], task["b"]
    messages = [SystemMessage("You are a careful assistant. Use the tools."), HumanMessage(f"What is {a} + {b}?")]
    called_right, answer = False, ""
    for _ in range(4):
        reply = await llm.ainvoke(messages)
        messages.append(reply)
        if not reply.tool_calls:
            answer = str(reply.content)
            break
        for call in reply.tool_calls:
            try:
                result = str(add.invoke(call["args"])) if call["name"] == "add" else f"no tool named {call['name']}"
            except Exception as exc:  # the model's arguments may not fit the tool: tell it, as an agent would
                result = f"error: {exc}"
            called_right = called_right or (call["name"] == "add" and result == str(a + b))
            messages.append(ToolMessage(result, tool_call_id=call["id"]))
    return 0.5 * called_right + 0.5 * (str(a + b) in answer)
