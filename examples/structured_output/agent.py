"""The OpenAI Agents SDK with an ``output_type``: the agent's answer must be a ``Digit`` (a pydantic model),
so the SDK asks for it as structured output (``text.format`` json_schema, strict); the server constrains
the sampling to that schema (xgrammar), so every answer parses, and trains the constrained turns as
off-policy samples of their known behaviour distribution (docs/protocol.md, "Processed sampling").

    agentjet-client run --code-dir examples/structured_output --server http://127.0.0.1:8000 --episodes 2000

Reward: 1 when the digit written is the task's. Set ``AGENTJET_DIGITS`` (e.g. ``3,8``) for a subset.
Tracing is off: nothing leaves the machine. Needs ``pip install openai-agents``.
"""

import os

from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, set_tracing_disabled
from pydantic import BaseModel, Field

from agentjet_client import swarm_agent

set_tracing_disabled(True)
WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


class Digit(BaseModel):
    """The answer: one digit."""

    digit: int = Field(ge=0, le=9)


def make_tasks() -> list[dict[str, object]]:
    chosen = os.environ.get("AGENTJET_DIGITS")
    digits = [int(d) for d in chosen.split(",")] if chosen else range(10)
    return [{"id": f"digit-{d}", "word": WORDS[d], "answer": d} for d in digits]


@swarm_agent(tasks=make_tasks, eval_tasks=make_tasks)
async def structured_digit(task, episode):
    agent = Agent(
        name="writer",
        model=OpenAIResponsesModel(model="agentjet-tiny", openai_client=episode.async_openai()),
        output_type=Digit,
        model_settings=ModelSettings(max_tokens=16, temperature=1.0),
    )
    result = await Runner.run(agent, f"Write {task['word']} as a digit.", max_turns=1)
    return 1.0 if result.final_output.digit == task["answer"] else 0.0
