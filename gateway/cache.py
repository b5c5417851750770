"""`RefreshingCache`: the gateway's read-through cache of store rows (API keys, sessions).

A store read costs a thread hop and an ORM query (~0.3-0.6 ms of CPU, and under load
several ms of waiting for the GIL); per request that dominated the gateway's own cost.
Entries are fresh for `ttl_s`. After that, an entry that holds a value is still served
for up to `stale_s` while ONE background reload runs (stale-while-revalidate): the
request does not wait on the store. A missing entry, a `None` (not found) or one older
than `stale_s` waits for the reload, which concurrent callers share (single flight).
What this process changes itself it writes through with `put` / `forget`, so only
another replica's changes are seen late, by at most `ttl_s` plus one reload.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class RefreshingCache(Generic[K, V]):
    """Values of `load(key)` (a blocking store read, run in a thread)."""

    def __init__(self, load: Callable[[K], V | None], *, ttl_s: float, stale_s: float,
                 max_entries: int = 100_000) -> None:
        if stale_s < ttl_s:
            raise ValueError(f"stale_s ({stale_s}) must be >= ttl_s ({ttl_s})")
        self._load = load
        self._ttl_s = ttl_s
        self._stale_s = stale_s
        self._max_entries = max_entries
        self._entries: dict[K, tuple[float, V | None]] = {}
        self._loading: dict[K, asyncio.Task[V | None]] = {}
        self._epoch = 0
        """Bumped by `forget`: a load that started before it is not cached."""

    async def get(self, key: K) -> V | None:
        """The value for `key` (None: the store has none)."""
        hit = self._entries.get(key)
        if hit is not None:
            age = time.monotonic() - hit[0]
            if age < self._ttl_s:
                return hit[1]
            if hit[1] is not None and age < self._stale_s:
                self._reload(key)  # in the background; this request goes on
                return hit[1]
        return await asyncio.shield(self._reload(key))

    def peek(self, key: K) -> V | None:
        """The cached value for `key`, fresh or stale, without any load (None: not
        cached, or cached as not found). For cheap checks that must not reach the store."""
        hit = self._entries.get(key)
        return None if hit is None else hit[1]

    def put(self, key: K, value: V | None) -> None:
        """Cache a value this process just wrote (its next read needs no store trip)."""
        if len(self._entries) >= self._max_entries:
            self._entries.clear()  # bounded: refill on demand
        self._entries[key] = (time.monotonic(), value)

    def forget(self, key: K | None = None) -> None:
        """Drop one entry, or all; loads in flight finish for their callers but are
        neither cached nor joined."""
        self._epoch += 1
        if key is None:
            self._entries.clear()
            self._loading.clear()
        else:
            self._entries.pop(key, None)
            self._loading.pop(key, None)

    def _reload(self, key: K) -> asyncio.Task[V | None]:
        """The load in flight for `key`, started if there is none. A task of its own:
        a caller that goes away does not cancel it for the others."""
        task = self._loading.get(key)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._fetch(key))
            task.add_done_callback(_retrieve)  # a failed background reload is not an error
            self._loading[key] = task
        return task

    async def _fetch(self, key: K) -> V | None:
        epoch = self._epoch
        try:
            value = await asyncio.to_thread(self._load, key)
        finally:
            if self._loading.get(key) is asyncio.current_task():
                del self._loading[key]
        if epoch == self._epoch:
            self.put(key, value)
        return value


def _retrieve(task: asyncio.Task[object]) -> None:
    """Mark the task's exception retrieved: whoever awaits the task still gets it; a
    background reload nobody awaits fails quietly and the next `get` tries again."""
    if not task.cancelled():
        task.exception()
