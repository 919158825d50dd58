"""Agent harnesses users bring, unmodified, on a real server through the episode's capture: the
OpenAI Agents SDK (its default Responses model and its chat-completions model, with a function
tool) and pydantic-ai (a tool, and streaming). The tiny model may call tools badly or never finish
(the harness then gives up, which is a model-quality outcome); what must not happen is an HTTP
error or a response the library cannot parse, and every call must be captured."""

from __future__ import annotations

import asyncio

import pytest

from agentjet_client import SwarmClient


def add(x: int, y: int) -> int:
    """Add two integers."""
    return x + y


async def in_episode(live_server, work):  # type: ignore[no-untyped-def]
    """Run ``work(episode)`` in one episode; its outcome, the captured turns and capture failures."""
    with SwarmClient(live_server.url) as client:
        episode = client.episode("harness")
        try:
            outcome = await work(episode)
        finally:
            trajectory = episode.to_trajectory(0.0)
            failures = episode.recorder.failures
            await episode.aclose()
            await client.aclose_pool()
    return outcome, trajectory.turns, failures


@pytest.mark.parametrize("api", ["responses", "chat"])
def test_openai_agents_sdk(live_server, api):
    from agents import (
        Agent,
        MaxTurnsExceeded,
        ModelBehaviorError,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)  # no trace upload: nothing leaves the machine

    async def work(episode):  # type: ignore[no-untyped-def]
        llm = episode.async_openai()
        model_class = OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel
        agent = Agent(
            name="adder",
            instructions="Use the add tool.",
            model=model_class(model="gpt-4o-mini", openai_client=llm),
            tools=[function_tool(add)],
            model_settings=ModelSettings(max_tokens=40, temperature=1.0),
        )
        try:
            result = await Runner.run(agent, "What is 2 + 3?", max_turns=3)
            return ("finished", result.final_output)
        except (MaxTurnsExceeded, ModelBehaviorError) as exc:  # the tiny model's doing, not the server's
            return ("gave up", f"{type(exc).__name__}: {exc}")

    outcome, turns, failures = asyncio.run(in_episode(live_server, work))
    assert failures == 0 and turns, outcome
    assert {t.requested_model for t in turns} == {"gpt-4o-mini"}
    print(f"openai-agents over {api}: {outcome}, {len(turns)} calls captured")


def test_pydantic_ai_tool_and_streaming(live_server):
    from pydantic_ai import Agent
    from pydantic_ai.exceptions import UnexpectedModelBehavior, UsageLimitExceeded
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.settings import ModelSettings
    from pydantic_ai.usage import UsageLimits

    async def work(episode):  # type: ignore[no-untyped-def]
        model = OpenAIChatModel("gpt-4o-mini", provider=OpenAIProvider(openai_client=episode.async_openai()))
        agent = Agent(model, tools=[add], model_settings=ModelSettings(max_tokens=40), retries=1)
        outcomes = []
        try:
            result = await agent.run("What is 2 + 3?", usage_limits=UsageLimits(request_limit=3))
            outcomes.append(("finished", str(result.output)))
        except (UnexpectedModelBehavior, UsageLimitExceeded) as exc:  # the tiny model's doing
            outcomes.append(("gave up", type(exc).__name__))
        plain = Agent(model, model_settings=ModelSettings(max_tokens=8))
        async with plain.run_stream("Write four as a digit.") as streamed:
            pieces = [piece async for piece in streamed.stream_text(delta=True)]
        outcomes.append(("streamed", "".join(pieces)))
        return outcomes

    outcome, turns, failures = asyncio.run(in_episode(live_server, work))
    assert failures == 0 and len(turns) >= 2, outcome
    print(f"pydantic-ai: {outcome}, {len(turns)} calls captured")


def test_smolagents_tool_calling_agent_two_steps(live_server):
    """smolagents' ToolCallingAgent: its system prompt alone is about 2,000 tokens (it needs the
    embedded model's 4,096-token context), through the capture proxy as any OpenAI-compatible API."""
    from smolagents import OpenAIServerModel, ToolCallingAgent, tool

    @tool
    def add_numbers(x: int, y: int) -> int:
        """Add two integers.

        Args:
            x: the first integer
            y: the second integer
        """
        return x + y

    async def work(episode):  # type: ignore[no-untyped-def]
        model = OpenAIServerModel(
            model_id="gpt-4o-mini", api_base=episode.url_for("default"), api_key=episode.api_key, max_tokens=40
        )
        agent = ToolCallingAgent(tools=[add_numbers], model=model, max_steps=2, verbosity_level=0)
        return await asyncio.to_thread(agent.run, "What is 2 + 3?")

    outcome, turns, failures = asyncio.run(in_episode(live_server, work))
    assert failures == 0 and turns, outcome  # up to two steps and the final answer it asks for
    assert max(len(t.prompt_token_ids) for t in turns) > 1024  # past the old context
    print(f"smolagents ToolCallingAgent: {outcome!r}, {len(turns)} calls captured")
