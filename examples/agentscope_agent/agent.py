"""An AgentScope 2.x agent with a toolkit, unchanged except for where its model comes from.

    pip install 'agentjet-client[agentscope]'
    agentjet-server up --port 8000 --model-size tools --lr 5e-4   # the embedded model that calls the listed tools
    agentjet-client run --code-dir examples/agentscope_agent --server http://127.0.0.1:8000 --episodes 640

``episode.agentscope()`` is AgentScope's own ``OpenAIChatModel`` (streaming, as AgentScope does by
default) on the episode's capture proxy. AgentScope's ``Agent`` runs its reasoning-acting loop:
it calls the model, runs the tools the model asks for from its ``Toolkit``, and calls the model
again with the results. Reward: 0.25 for calling ``add``, 0.25 more if with the task's numbers,
0.5 for a final answer that contains the sum.
"""

from agentscope.agent import Agent, InjectionConfig, ReActConfig
from agentscope.message import TextBlock, UserMsg
from agentscope.tool import FunctionTool, Toolkit, ToolResponse

from agentjet_client import swarm_agent


def make_add(calls: list[tuple[int, int]]):
    """The episode's ``add`` tool; it notes each call so the reward can credit the right one."""

    def add(a: int, b: int) -> ToolResponse:
        """Add two integers.

        Args:
            a: the first number
            b: the second number
        """
        calls.append((a, b))
        return ToolResponse(content=[TextBlock(type="text", text=str(a + b))])

    return add


def make_tasks() -> list[dict[str, object]]:
    pairs = [(2, 3), (4, 1), (3, 3), (1, 6)]
    return [{"id": f"add-{a}-{b}", "a": a, "b": b} for a, b in pairs]


@swarm_agent(tasks=make_tasks)
async def scope_adder(task, episode):
    a, b = task["a"], task["b"]
    calls: list[tuple[int, int]] = []
    agent = Agent(
        name="adder",
        system_prompt="You are a careful assistant. Use the tools.",
        model=episode.agentscope(max_tokens=40, temperature=1.0),
        # read-only: AgentScope 2.x runs such a tool without asking for permission; any other tool
        # waits for a user's approval, which an unattended episode never gives (the call never runs)
        toolkit=Toolkit(tools=[FunctionTool(make_add(calls), is_read_only=True)]),
        react_config=ReActConfig(max_iters=3),
        # AgentScope writes the current time into the prompt by default: the episodes of a GRPO
        # group would each see a different prompt, and the time teaches the policy nothing
        injection_config=InjectionConfig(inject_runtime_state=False),
    )
    reply = await agent.reply(UserMsg(name="user", content=f"What is {a} + {b}?"))
    used_tool = 0.25 * bool(calls) + 0.25 * any(sorted(c) == sorted((a, b)) for c in calls)
    return used_tool + 0.5 * (str(a + b) in (reply.get_text_content() or ""))
