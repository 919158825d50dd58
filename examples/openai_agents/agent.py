"""The OpenAI Agents SDK on its default model, which speaks the Responses API: an ``Agent`` with a
function tool, run by ``Runner.run`` unchanged; the episode hands it a captured ``AsyncOpenAI``.

    agentjet-server up --port 8000 --model-size tools --lr 5e-4   # the embedded model that calls the listed tools
    agentjet-client run --code-dir examples/openai_agents --server http://127.0.0.1:8000 --episodes 640

The SDK sends each turn's whole conversation as Responses items (messages, ``function_call`` and
``function_call_output``); the server reads them as the chat conversation they are, so every
episode is trained as one timeline of exactly the sampled tokens. Tracing is off: nothing leaves
the machine. Needs ``pip install openai-agents``.

Reward: 0.5 for calling ``add`` with the task's numbers, 0.5 for a final answer that contains the sum.
A run the SDK gives up on (the model called a tool the agent does not have, or ran out of turns)
ends the episode with what was earned so far.
"""

from agents import (
    Agent,
    AgentsException,
    ModelSettings,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)

from agentjet_client import swarm_agent

set_tracing_disabled(True)


def make_tasks() -> list[dict[str, object]]:
    pairs = [(2, 3), (4, 1), (3, 3), (1, 6), (5, 2), (2, 2)]
    return [{"id": f"add-{a}-{b}", "a": a, "b": b} for a, b in pairs]


@swarm_agent(tasks=make_tasks)
async def agents_sdk(task, episode):
    a, b = task["a"], task["b"]
    calls: list[tuple[int, int]] = []

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        calls.append((a, b))
        return a + b

    agent = Agent(
        name="calculator",
        instructions="You are a careful assistant. Use the tools.",
        model=OpenAIResponsesModel(model="gpt-4o-mini", openai_client=episode.async_openai()),
        tools=[add],
        model_settings=ModelSettings(max_tokens=40, temperature=1.0),
    )
    answer = ""
    try:
        result = await Runner.run(agent, f"What is {a} + {b}?", max_turns=4)
        answer = str(result.final_output or "")
    except AgentsException:  # the SDK gave up on what the model did: the episode keeps what it earned
        pass
    called_right = any(sorted(call) == sorted((a, b)) for call in calls)
    return 0.5 * called_right + 0.5 * (str(a + b) in answer)
