"""Running one episode of a user's agent (or the built-in single-turn agent) against
the gateway, for the dataset driver and evaluation.

An agent is `async def agent(sample, base_url, api_key) -> float | {completion_id:
reward}`; it talks to `base_url` (the gateway's `/v1`) with `api_key` (a session key
while training) and may keep any model name. It may also declare `temperature` and
`max_tokens` parameters (or `**kwargs`): evaluation passes its greedy/sampled settings
through them. A sync function runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from areal_service.rewards import RewardFn, import_callable, load_reward

log = logging.getLogger(__name__)

AgentFn = Callable[..., Any]


@dataclass(frozen=True, slots=True)
class EpisodeResult:
    """What one episode produced."""

    reward: float
    """The episode's reward (the sum when the agent scored completions one by one)."""
    completion_rewards: Mapping[str, float] | None = None
    """Per-completion rewards the agent returned, else None."""
    completion_tokens: int | None = None
    """Output tokens, when the runner saw them (the built-in agent)."""
    error: str | None = None
    """Why the agent failed (its reward is then 0)."""


class SingleTurnAgent:
    """The built-in agent: one chat completion of the sample's `messages`, scored by a
    reward function. One shared `openai` client; each call uses its own key."""

    def __init__(self, base_url: str, model: str, reward: RewardFn) -> None:
        import openai

        self.client = openai.AsyncOpenAI(
            base_url=base_url, api_key="unused", max_retries=3, timeout=600
        )
        self.model = model
        self.reward = reward

    async def __call__(
        self,
        sample: Mapping[str, Any],
        base_url: str,
        api_key: str,
        *,
        temperature: float | None = None,
        max_tokens: int | None = None,
    ) -> EpisodeResult:
        extra: dict[str, Any] = {}
        if temperature is not None:
            extra["temperature"] = temperature
        if max_tokens is not None:
            extra["max_tokens"] = max_tokens
        reply = await self.client.with_options(api_key=api_key).chat.completions.create(
            model=self.model, messages=list(sample["messages"]), **extra
        )
        text = reply.choices[0].message.content
        value = self.reward(text, sample)
        if inspect.isawaitable(value):
            value = await value
        tokens = reply.usage.completion_tokens if reply.usage else None
        return EpisodeResult(float(value), completion_tokens=tokens)

    async def aclose(self) -> None:
        """Close the HTTP client."""
        await self.client.close()


class AgentRunner:
    """Runs episodes with the configured agent and turns what it returns into an
    `EpisodeResult`; a failing agent scores 0 with the error kept (logged once per
    kind), so one bad episode never stops a run."""

    def __init__(self, base_url: str, *, agent: str | None, reward: str, model: str) -> None:
        self.base_url = base_url
        self._builtin: SingleTurnAgent | None = None
        if agent is None:
            self._builtin = SingleTurnAgent(base_url, model, load_reward(reward))
            self._agent: AgentFn = self._builtin
            self._accepts = {"temperature", "max_tokens"}
        else:
            self._agent = import_callable(agent)
            self._accepts = _keyword_params(self._agent, {"temperature", "max_tokens"})
        self._seen_errors: set[str] = set()

    async def run(
        self,
        sample: Mapping[str, Any],
        api_key: str,
        *,
        temperature: float | None = None,
        max_tokens: int | None = None,
    ) -> EpisodeResult:
        """One episode; never raises for an agent failure."""
        options = {
            k: v
            for k, v in (("temperature", temperature), ("max_tokens", max_tokens))
            if v is not None and k in self._accepts
        }
        try:
            if inspect.iscoroutinefunction(self._agent) or self._builtin is not None:
                out = await self._agent(sample, self.base_url, api_key, **options)
            else:
                out = await asyncio.to_thread(
                    self._agent, sample, self.base_url, api_key, **options
                )
                if inspect.isawaitable(out):
                    out = await out
            return _result(out)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - an agent's failure is a zero reward
            kind = type(exc).__name__
            if kind not in self._seen_errors:
                self._seen_errors.add(kind)
                log.warning(
                    "agent failed (%s: %s); such episodes score 0",
                    kind,
                    exc,
                    exc_info=log.isEnabledFor(logging.DEBUG),
                )
            return EpisodeResult(0.0, error=f"{kind}: {exc}"[:500])

    async def aclose(self) -> None:
        """Close the built-in agent's client."""
        if self._builtin is not None:
            await self._builtin.aclose()


def _keyword_params(fn: AgentFn, wanted: set[str]) -> set[str]:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return set()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return set(wanted)
    return {p.name for p in params if p.name in wanted}


def _result(out: Any) -> EpisodeResult:
    if isinstance(out, EpisodeResult):
        return out
    if isinstance(out, Mapping):
        values = {str(k): float(v) for k, v in out.items()}
        bad = [k for k, v in values.items() if not math.isfinite(v)]
        if bad:
            raise ValueError(f"agent returned non-finite rewards for {bad}")
        return EpisodeResult(sum(values.values()), completion_rewards=values)
    if not isinstance(out, int | float):  # bool counts: True is 1.0
        raise TypeError(
            f"agent returned {type(out).__name__}; expected a float or {{completion_id: reward}}"
        )
    if not math.isfinite(out):
        raise ValueError(f"agent returned a non-finite reward {out}")
    return EpisodeResult(float(out))
