"""Plain `openai` client agents, written as for OpenAI itself: only `base_url` and
`api_key` come from the caller (the dataset driver passes the gateway and a session key).

- `single_turn`: one question, one answer (model `gpt-4o-mini`).
- `multi_turn`: answer, then a follow-up turn asking to check the work and restate the
  final answer (model `default`); the whole conversation is one episode.

Both return a math-verify reward against the sample's GSM8K answer.
"""

from __future__ import annotations

from typing import Any

from openai import AsyncOpenAI

from areal_service.rewards import math_reward

ASK = "{question}\nGive the final answer on its own line as '#### <number>'."
CHECK = "Check your work step by step, then restate the final answer as '#### <number>'."


async def single_turn(
    sample: dict[str, Any],
    base_url: str,
    api_key: str,
    *,
    temperature: float | None = None,
    max_tokens: int | None = None,
) -> float:
    """Ask once; reward the reply."""
    async with AsyncOpenAI(base_url=base_url, api_key=api_key) as client:
        reply = await client.chat.completions.create(
            model="gpt-4o-mini",
            messages=[{"role": "user", "content": ASK.format(question=sample["question"])}],
            **_options(temperature, max_tokens),
        )
    return math_reward(reply.choices[0].message.content, sample)


async def multi_turn(
    sample: dict[str, Any],
    base_url: str,
    api_key: str,
    *,
    temperature: float | None = None,
    max_tokens: int | None = None,
) -> float:
    """Ask, then ask for a checked final answer in the same conversation; reward the
    last reply."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a careful math tutor."},
        {"role": "user", "content": ASK.format(question=sample["question"])},
    ]
    async with AsyncOpenAI(base_url=base_url, api_key=api_key) as client:
        for follow_up in (CHECK, None):
            reply = await client.chat.completions.create(
                model="default", messages=messages, **_options(temperature, max_tokens)
            )
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
            if follow_up:
                messages.append({"role": "user", "content": follow_up})
    return math_reward(messages[-1]["content"], sample)


def _options(temperature: float | None, max_tokens: int | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if temperature is not None:
        out["temperature"] = temperature
    if max_tokens is not None:
        out["max_tokens"] = max_tokens
    return out
