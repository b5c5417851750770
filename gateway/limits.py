"""Per-key limits on the generation routes: requests/min, tokens/min, requests in flight
and a total token budget, set on the key (`ApiKeyRecord.rpm_limit`, `tpm_limit`,
`max_concurrent`, `token_budget`; None: unlimited). Past one, 429 in the OpenAI shape
with `retry-after`.

Counted in memory, per process (with several gateway processes each enforces the
limits on its own share): sliding 60-second windows of request times and of
(time, tokens), an in-flight count, and the key's running token total, which starts
from the stored `tokens_used` when the process first sees the key and whose increments
the key-usage flush writes back (`gateway/auth.py`). Tokens are known when a reply is
complete, so the token checks refuse the request after the one that went over: a
single request may overshoot a per-minute or total figure by its own size.

The admin key has no row and no limits. Cost for a key without limits: one attribute
check per request.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from areal_service.types import ApiKeyRecord
from gateway.errors import OpenAIError

WINDOW_S = 60.0
Keep = Callable[[AsyncIterator[str]], AsyncIterator[str]]


@dataclass(slots=True)
class _KeyState:
    requests: deque[float] = field(default_factory=deque)
    tokens: deque[tuple[float, int]] = field(default_factory=deque)
    tokens_in_window: int = 0
    in_flight: int = 0
    total: int | None = None
    """Tokens used in total (stored figure at first sight + what this process counted)."""


def has_limits(key: ApiKeyRecord) -> bool:
    """Whether any limit is set on `key`."""
    return any(v is not None for v in (key.rpm_limit, key.tpm_limit, key.max_concurrent,
                                       key.token_budget))


def rate_limited(message: str, retry_after_s: float, code: str) -> OpenAIError:
    """429 `rate_limit_error` with a whole-second `retry-after` (at least 1)."""
    return OpenAIError(429, message, type="rate_limit_error", code=code,
                       headers={"retry-after": str(max(1, math.ceil(retry_after_s)))})


class KeyLimits:
    """The per-key counters of one gateway process.

    `on_tokens(key_id, n)` is told of every token count (the key-usage flush that
    persists `tokens_used`)."""

    def __init__(self, on_tokens: Callable[[str, int], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._keys: dict[str, _KeyState] = {}
        self._on_tokens = on_tokens
        self._clock = clock

    def _state(self, key: ApiKeyRecord) -> _KeyState:
        state = self._keys.get(key.id)
        if state is None:
            state = self._keys[key.id] = _KeyState()
        if state.total is None:
            state.total = key.tokens_used
        return state

    def _expire(self, state: _KeyState, now: float) -> None:
        horizon = now - WINDOW_S
        while state.requests and state.requests[0] <= horizon:
            state.requests.popleft()
        while state.tokens and state.tokens[0][0] <= horizon:
            state.tokens_in_window -= state.tokens.popleft()[1]

    def admit(self, key: ApiKeyRecord | None) -> bool:
        """Count one request of `key` (None: the admin) in flight, or raise 429. True
        when the caller must `release` it later."""
        if key is None or not has_limits(key):
            return False
        now = self._clock()
        state = self._state(key)
        self._expire(state, now)
        if key.token_budget is not None and (state.total or 0) >= key.token_budget:
            raise rate_limited(
                f"this key has used its token budget ({state.total:,} of "
                f"{key.token_budget:,} tokens); ask an admin to raise it",
                WINDOW_S, "token_budget_exhausted")
        if key.max_concurrent is not None and state.in_flight >= key.max_concurrent:
            raise rate_limited(
                f"this key already has {state.in_flight} requests in flight (limit "
                f"{key.max_concurrent})", 1, "concurrency_limit_exceeded")
        if key.rpm_limit is not None and len(state.requests) >= key.rpm_limit:
            wait = state.requests[len(state.requests) - key.rpm_limit] + WINDOW_S - now
            raise rate_limited(
                f"rate limit of {key.rpm_limit} requests per minute reached for this key",
                wait, "rate_limit_exceeded")
        if key.tpm_limit is not None and state.tokens_in_window >= key.tpm_limit:
            wait = state.tokens[0][0] + WINDOW_S - now if state.tokens else 1
            raise rate_limited(
                f"rate limit of {key.tpm_limit:,} tokens per minute reached for this key "
                f"({state.tokens_in_window:,} used in the last minute)", wait,
                "rate_limit_exceeded")
        state.requests.append(now)
        state.in_flight += 1
        return True

    def release(self, key: ApiKeyRecord | None) -> None:
        """One admitted request of `key` is done (reply sent, failed or abandoned)."""
        if key is not None and (state := self._keys.get(key.id)) is not None:
            state.in_flight = max(0, state.in_flight - 1)

    def spent(self, key: ApiKeyRecord | None, tokens: int) -> None:
        """`tokens` (prompt + completion) used by one reply of `key`."""
        if key is None or tokens <= 0:
            return
        if self._on_tokens is not None:
            self._on_tokens(key.id, tokens)
        if not has_limits(key):
            return
        state = self._state(key)
        state.tokens.append((self._clock(), tokens))
        state.tokens_in_window += tokens
        state.total = (state.total or 0) + tokens

    @contextlib.asynccontextmanager
    async def holding(self, key: ApiKeyRecord | None) -> AsyncIterator[Keep]:
        """Admit `key`'s request for the block (429 when over a limit). Yields `keep`,
        which hands the in-flight count on to a streamed reply: the request stays in
        flight until the stream ends (or is closed) rather than when the block exits."""
        counted = self.admit(key)
        handed_on = False

        def keep(events: AsyncIterator[str]) -> AsyncIterator[str]:
            nonlocal handed_on
            if not counted:
                return events
            handed_on = True
            return _ReleasedAfter(self, key, events)

        try:
            yield keep
        finally:
            if counted and not handed_on:
                self.release(key)


class _ReleasedAfter:
    """A streamed reply's events that release their request's slot exactly once: at the
    end, on an error, on `aclose`, or (never iterated: the client left before the first
    byte) when dropped."""

    def __init__(self, limits: KeyLimits, key: ApiKeyRecord | None,
                 events: AsyncIterator[str]) -> None:
        self._limits = limits
        self._key = key
        self._events = events
        self._released = False

    def __aiter__(self) -> _ReleasedAfter:
        return self

    async def __anext__(self) -> str:
        try:
            return await anext(self._events)
        except BaseException:  # StopAsyncIteration included: the stream is over
            self._release()
            raise

    async def aclose(self) -> None:
        """Release the slot and close the underlying events."""
        self._release()
        close = getattr(self._events, "aclose", None)
        if close is not None:
            await close()

    def _release(self) -> None:
        if not self._released:
            self._released = True
            self._limits.release(self._key)

    def __del__(self) -> None:
        self._release()
