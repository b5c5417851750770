"""A math agent on the OpenAI Agents SDK with calculator tools, as its author would
write it for OpenAI (model `gpt-4o-mini`); only `base_url` and `api_key` point at the
gateway, through `OpenAIProvider`. Rewarded with math-verify against the GSM8K answer.

The dataset driver calls `solve(sample, base_url, api_key)` once per session.
"""

from __future__ import annotations

from typing import Any

from agents import (
    Agent,
    AgentsException,
    ModelSettings,
    OpenAIProvider,
    RunConfig,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

from areal_service.rewards import math_reward

MODEL = "gpt-4o-mini"
INSTRUCTIONS = (
    "Solve the math word problem step by step. Use the calculator tools for every "
    "arithmetic operation. Finish with the final answer on its own line as '#### <number>'."
)
MAX_TURNS = 8


@function_tool
def add(a: float, b: float) -> float:
    """Return a + b."""
    return a + b


@function_tool
def subtract(a: float, b: float) -> float:
    """Return a - b."""
    return a - b


@function_tool
def multiply(a: float, b: float) -> float:
    """Return a * b."""
    return a * b


@function_tool
def divide(a: float, b: float) -> float:
    """Return a / b (b must not be 0)."""
    return a / b


def make_agent(max_tokens: int | None = None) -> Agent:
    """The calculator agent."""
    return Agent(
        name="math-solver",
        instructions=INSTRUCTIONS,
        model=MODEL,
        tools=[add, subtract, multiply, divide],
        model_settings=ModelSettings(max_tokens=max_tokens),
    )


async def solve(
    sample: dict[str, Any],
    base_url: str,
    api_key: str,
    *,
    temperature: float | None = None,
    max_tokens: int | None = None,
) -> float:
    """Run the agent on one problem; 1.0 when its final answer is right."""
    set_tracing_disabled(True)  # tracing would upload to api.openai.com with our key
    client = AsyncOpenAI(base_url=base_url, api_key=api_key)
    provider = OpenAIProvider(openai_client=client, use_responses=False)
    agent = make_agent(max_tokens)
    if temperature is not None:
        agent = agent.clone(
            model_settings=ModelSettings(max_tokens=max_tokens, temperature=temperature)
        )
    try:
        result = await Runner.run(
            agent,
            sample["question"],
            max_turns=MAX_TURNS,
            run_config=RunConfig(model_provider=provider),
        )
        answer = str(result.final_output)
    except AgentsException:  # too many turns, a malformed tool call: a wrong answer
        answer = ""
    finally:
        await client.close()
    return math_reward(answer, sample)
