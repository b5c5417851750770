"""Agents the dataset-driver tests load by import path (`support.driver_agents:...`;
tests/ is on sys.path through pytest's `pythonpath` option)."""

from __future__ import annotations

from typing import Any

from openai import AsyncOpenAI


async def per_completion(sample: dict[str, Any], base_url: str, api_key: str) -> dict[str, float]:
    """Two turns, each scored on its own: `{completion_id: reward}`."""
    async with AsyncOpenAI(base_url=base_url, api_key=api_key) as client:
        ids = []
        for _ in range(2):
            reply = await client.chat.completions.create(
                model="my-agent-model", messages=sample["messages"], max_tokens=4
            )
            ids.append(reply.id)
    return {ids[0]: 0.25, ids[1]: 0.5}


def broken(sample: dict[str, Any], base_url: str, api_key: str) -> float:
    """A sync agent that fails: the driver scores the episode 0 and keeps going."""
    raise RuntimeError("tool crashed")
