"""Per-key limits on the generation routes: requests/min, tokens/min, requests in flight
and a total token budget, set on the key (`ApiKeyRecord.rpm_limit`, `tpm_limit`,
`max_concurrent`, `token_budget`; None: unlimited). Past one, 429 in the OpenAI shape
with `retry-after`.

Counted in memory: sliding 60-second windows of request times and of (time, tokens), an
in-flight count, and the key's running token total, which starts from the stored
`tokens_used` when the process first sees the key and whose increments the key-usage
flush writes back (`gateway/auth.py`). With several gateway processes on one store
(workers, replicas) each publishes its counts of the keys it served lately and reads the
others' every `gateway.limits.key_limits_sync_s` (`sync_key_limits`,
`areal_service/store/key_counters.py`); a limit then counts every process, and N
processes together can pass it by at most what they admit within one sync interval.
Tokens are known when a reply is complete, so the token checks refuse the request after
the one that went over: a single request may overshoot a per-minute or total figure by
its own size.

The admin key has no row and no limits. Cost for a key without limits: one attribute
check per request.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from areal_service.types import ApiKeyRecord, KeyCounts
from gateway.errors import OpenAIError

log = logging.getLogger(__name__)

WINDOW_S = 60.0


class Events(Protocol):
    """A streamed reply's SSE texts, closable early: an async generator, or what `keep`
    wraps one in (it releases the request's slot). Spelled out: on Python 3.11 a
    Protocol cannot subclass `collections.abc.AsyncIterator`."""

    def __aiter__(self) -> AsyncIterator[str]: ...

    def __anext__(self) -> Awaitable[str]: ...

    def aclose(self) -> Awaitable[object]: ...


Keep = Callable[[Events], Events]


@dataclass(slots=True)
class _KeyState:
    requests: deque[float] = field(default_factory=deque)
    tokens: deque[tuple[float, int]] = field(default_factory=deque)
    tokens_in_window: int = 0
    in_flight: int = 0
    total: int | None = None
    """Tokens used in total (stored figure at first sight, or at the last sync with the
    other processes' unflushed counts, + what this process counted since)."""
    peers: KeyCounts = field(default_factory=KeyCounts)
    """The other gateway processes' counts at the last sync (zero when alone)."""
    last_seen: float = 0.0


def has_limits(key: ApiKeyRecord) -> bool:
    """Whether any limit is set on `key`."""
    # No generator: this runs twice a request.
    return not (
        key.rpm_limit is None
        and key.tpm_limit is None
        and key.max_concurrent is None
        and key.token_budget is None
    )


def rate_limited(message: str, retry_after_s: float, code: str) -> OpenAIError:
    """429 `rate_limit_error` with a whole-second `retry-after` (at least 1)."""
    return OpenAIError(
        429,
        message,
        type="rate_limit_error",
        code=code,
        headers={"retry-after": str(max(1, math.ceil(retry_after_s)))},
    )


class KeyLimits:
    """The per-key counters of one gateway process.

    `on_tokens(key_id, n)` is told of every token count (the key-usage flush that
    persists `tokens_used`)."""

    def __init__(
        self,
        on_tokens: Callable[[str, int], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
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
        state.last_seen = now
        peers = state.peers
        if key.token_budget is not None and (state.total or 0) >= key.token_budget:
            raise rate_limited(
                f"this key has used its token budget ({state.total:,} of "
                f"{key.token_budget:,} tokens); ask an admin to raise it",
                WINDOW_S,
                "token_budget_exhausted",
            )
        in_flight = state.in_flight + peers.in_flight
        if key.max_concurrent is not None and in_flight >= key.max_concurrent:
            raise rate_limited(
                f"this key already has {in_flight} requests in flight (limit {key.max_concurrent})",
                1,
                "concurrency_limit_exceeded",
            )
        requests = len(state.requests)
        if key.rpm_limit is not None and requests + peers.requests >= key.rpm_limit:
            over = requests + peers.requests - key.rpm_limit  # this many must expire first
            wait = state.requests[over] + WINDOW_S - now if over < requests else 1
            raise rate_limited(
                f"rate limit of {key.rpm_limit} requests per minute reached for this key",
                wait,
                "rate_limit_exceeded",
            )
        tokens = state.tokens_in_window + peers.tokens
        if key.tpm_limit is not None and tokens >= key.tpm_limit:
            wait = state.tokens[0][0] + WINDOW_S - now if state.tokens else 1
            raise rate_limited(
                f"rate limit of {key.tpm_limit:,} tokens per minute reached for this key "
                f"({tokens:,} used in the last minute)",
                wait,
                "rate_limit_exceeded",
            )
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

    def counts(
        self, unflushed: Mapping[str, int], idle_s: float = 2 * WINDOW_S
    ) -> dict[str, KeyCounts]:
        """This process's counts of the keys with limits it saw within `idle_s` or still
        counts something for (what `sync_key_limits` publishes); `unflushed`: tokens per
        key not yet in the stored `tokens_used`."""
        now = self._clock()
        out: dict[str, KeyCounts] = {}
        for key_id, state in self._keys.items():
            self._expire(state, now)
            if now - state.last_seen > idle_s and not state.in_flight and not state.requests:
                state.peers = KeyCounts()  # not synced: unknown until it is again
                continue
            out[key_id] = KeyCounts(
                len(state.requests),
                state.tokens_in_window,
                state.in_flight,
                unflushed.get(key_id, 0),
            )
        return out

    def apply(
        self,
        mine: Mapping[str, KeyCounts],
        peers: Mapping[str, KeyCounts],
        tokens_used: Mapping[str, int],
    ) -> None:
        """The other processes' counts and the stored `tokens_used` of the keys in `mine`
        (what was published), read back in the same sync. The running total becomes the
        stored figure plus every process's unflushed tokens (a flush in progress may be
        missed or counted twice for one sync)."""
        for key_id, own in mine.items():
            state = self._keys.get(key_id)
            if state is None:
                continue
            state.peers = peers.get(key_id, KeyCounts())
            if key_id in tokens_used:
                state.total = (
                    tokens_used[key_id] + own.unflushed_tokens + state.peers.unflushed_tokens
                )

    def holding(self, key: ApiKeyRecord | None) -> Holding:
        """Admit `key`'s request for an `async with` block (429 when over a limit). The
        block gets `keep`, which hands the in-flight count on to a streamed reply: the
        request stays in flight until the stream ends (or is closed) rather than when the
        block exits."""
        return Holding(self, key)


class Holding:
    """`KeyLimits.holding`'s context: one object a request, where an
    `asynccontextmanager` cost a generator, its wrapper, a closure and a
    `StopAsyncIteration` at exit (~2 us and 6 GC-tracked objects a request)."""

    __slots__ = ("_counted", "_key", "_limits")

    def __init__(self, limits: KeyLimits, key: ApiKeyRecord | None) -> None:
        self._limits = limits
        self._key = key
        self._counted = False

    async def __aenter__(self) -> Keep:
        self._counted = self._limits.admit(self._key)
        return self.keep

    async def __aexit__(self, *exc: object) -> None:
        if self._counted:
            self._counted = False
            self._limits.release(self._key)

    def keep(self, events: Events) -> Events:
        """`events`, releasing the request's count when they end (unchanged when the
        request was not counted); the block's exit then releases nothing."""
        if not self._counted:
            return events
        self._counted = False
        return _ReleasedAfter(self._limits, self._key, events)


class CountsExchange(Protocol):
    """The store's side of `sync_key_limits` (`store.coordination`)."""

    def exchange_key_counts(
        self, holder: str, counts: Mapping[str, KeyCounts], fresh_s: float
    ) -> tuple[dict[str, KeyCounts], dict[str, int]]: ...


async def sync_key_limits(
    limits: KeyLimits,
    unflushed: Callable[[], Mapping[str, int]],
    store: CountsExchange,
    holder: str,
    interval_s: float,
) -> None:
    """Every `interval_s`, forever: publish this process's counts of its active limited
    keys and take the other processes' (rows older than five intervals are from gone
    processes). A failed exchange is logged; the last known counts stay in force."""
    while True:
        await asyncio.sleep(interval_s)
        mine = limits.counts(unflushed())
        if not mine:
            continue
        try:
            peers, used = await asyncio.to_thread(
                store.exchange_key_counts, holder, mine, 5 * interval_s
            )
        except Exception:  # the database may be briefly unavailable
            log.warning("sharing per-key limit counts failed", exc_info=True)
            continue
        limits.apply(mine, peers, used)


class _ReleasedAfter:
    """A streamed reply's events that release their request's slot exactly once: at the
    end, on an error, on `aclose`, or (never iterated: the client left before the first
    byte) when dropped."""

    def __init__(self, limits: KeyLimits, key: ApiKeyRecord | None, events: Events) -> None:
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
