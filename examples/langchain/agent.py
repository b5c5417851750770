"""A LangChain agent: `ChatOpenAI` with `bind_tools` and a plain tool loop (call the
model; run the tools it asks for; feed the results back; stop at a text answer). The
model name is the author's own (`qwen2.5-7b-instruct`); only `base_url` and `api_key`
point at the gateway. Rewarded with math-verify.
"""

from __future__ import annotations

from typing import Any

import httpx
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

from areal_service.rewards import math_reward

MAX_ROUNDS = 4


@tool
def add(a: float, b: float) -> float:
    """Add two numbers."""
    return a + b


@tool
def multiply(a: float, b: float) -> float:
    """Multiply two numbers."""
    return a * b


@tool
def subtract(a: float, b: float) -> float:
    """Subtract b from a."""
    return a - b


TOOLS = {t.name: t for t in (add, multiply, subtract)}


async def solve(
    sample: dict[str, Any],
    base_url: str,
    api_key: str,
    *,
    temperature: float | None = None,
    max_tokens: int | None = None,
) -> float:
    """Tool loop on one problem; 1.0 when the final answer is right."""
    # An HTTP client per episode: langchain-openai's default one is cached process-wide
    # and bound to the first event loop that used it.
    async with httpx.AsyncClient(timeout=600) as http:
        llm = ChatOpenAI(
            model="qwen2.5-7b-instruct",
            base_url=base_url,
            api_key=api_key,
            temperature=temperature,
            max_tokens=max_tokens,
            max_retries=2,
            http_async_client=http,
        )
        answer = await _tool_loop(llm.bind_tools(list(TOOLS.values())), sample["question"])
    return math_reward(answer, sample)


async def _tool_loop(model: Any, question: str) -> str:
    """Model, tools, model, ... until a reply without tool calls (or MAX_ROUNDS)."""
    messages: list[BaseMessage] = [
        SystemMessage("Use the tools for arithmetic. End with '#### <number>'."),
        HumanMessage(question),
    ]
    for _ in range(MAX_ROUNDS):
        reply: AIMessage = await model.ainvoke(messages)
        messages.append(reply)
        if not reply.tool_calls:
            return str(reply.content)
        for call in reply.tool_calls:
            fn = TOOLS.get(call["name"])
            try:
                result = fn.invoke(call["args"]) if fn else f"unknown tool {call['name']}"
            except Exception as exc:  # noqa: BLE001 - the model sees the tool's error
                result = f"error: {exc}"
            messages.append(ToolMessage(str(result), tool_call_id=call["id"]))
    return ""
