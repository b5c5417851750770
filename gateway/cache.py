"""`RefreshingCache`: the gateway's read-through cache of store rows (API keys, sessions).

A store read costs a thread hop and an ORM query (~0.3-0.6 ms of CPU, and under load
several ms of waiting for the GIL); per request that dominated the gateway's own cost.
Entries are fresh for `ttl_s`. After that, an entry that holds a value is still served
for up to `stale_s` while a background reload runs (stale-while-revalidate): the
request does not wait on the store. A missing entry, a `None` (not found) or one older
than `stale_s` waits for the reload, which concurrent callers share (single flight).
What this process changes itself it writes through with `put` / `forget`, so only
another replica's changes are seen late, by at most `ttl_s` plus one reload.

Reloads are batched: every key that needs one joins the next batch, and one batch at a
time is read with `load_many` (one thread hop, one `IN (...)` query for up to
`MAX_BATCH` keys). Under load, where many entries go stale together (every episode's
key and session, made up front), a per-key thread hop and query was ~8% of a plain
request's CPU; a miss now waits at most for the batch in flight before its own.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Hashable, Mapping
from itertools import islice
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

MAX_BATCH = 500
"""Keys per store query: well inside SQLite's and PostgreSQL's bound-parameter limits."""


class RefreshingCache(Generic[K, V]):
    """Values of `load_many(keys)` (a blocking store read of several keys, run in a
    thread; a key it leaves out has no value)."""

    def __init__(
        self,
        load_many: Callable[[list[K]], Mapping[K, V]],
        *,
        ttl_s: float,
        stale_s: float,
        max_entries: int = 100_000,
    ) -> None:
        if stale_s < ttl_s:
            raise ValueError(f"stale_s ({stale_s}) must be >= ttl_s ({ttl_s})")
        self._load_many = load_many
        self._ttl_s = ttl_s
        self._stale_s = stale_s
        self._max_entries = max_entries
        self._entries: dict[K, tuple[float, V | None]] = {}
        self._loading: dict[K, asyncio.Future[V | None]] = {}
        """The load each key's callers join: queued or in a batch in flight."""
        self._queued: dict[K, asyncio.Future[V | None]] = {}
        """Keys waiting for the next batch (their loads have not started)."""
        self._batcher: asyncio.Task[None] | None = None
        """The task reading batches, while there are any to read."""
        self._epoch = 0
        """Bumped by `forget`: a load that started before it is not cached."""
        self.batches = 0
        """Store reads made so far (for tests and profiling)."""

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
        # Shielded: a caller that goes away does not cancel the load for the others.
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
        neither cached nor joined (a queued load has not started: it is still joined)."""
        self._epoch += 1
        if key is None:
            self._entries.clear()
            self._loading.clear()
        else:
            self._entries.pop(key, None)
            self._loading.pop(key, None)

    def _reload(self, key: K) -> asyncio.Future[V | None]:
        """The load in flight or queued for `key`, queued if there is none."""
        future = self._loading.get(key)
        if future is None:
            future = self._queued.get(key)
            if future is None:
                future = asyncio.get_running_loop().create_future()
                self._queued[key] = future
            self._loading[key] = future
            if self._batcher is None:
                self._batcher = asyncio.get_running_loop().create_task(self._read_batches())
        return future

    async def _read_batches(self) -> None:
        """Read queued keys, a batch at a time, until none is left. Keys queued while a
        batch is read go in the next one."""
        try:
            while self._queued:
                batch = dict(islice(self._queued.items(), MAX_BATCH))
                for key in batch:
                    del self._queued[key]
                await self._read(batch)
        finally:
            self._batcher = None

    async def _read(self, batch: dict[K, asyncio.Future[V | None]]) -> None:
        epoch = self._epoch
        self.batches += 1
        try:
            values = await asyncio.to_thread(self._load_many, list(batch))
        except Exception as error:  # each waiting caller gets it; the next get retries
            self._settle(batch)
            for future in batch.values():
                if not future.done():
                    future.set_exception(error)
                    future.exception()  # a background reload nobody awaits fails quietly
            return
        except BaseException:  # cancelled (shutdown): so are the loads
            self._settle(batch)
            for future in batch.values():
                future.cancel()
            raise
        self._settle(batch)
        cache = epoch == self._epoch
        for key, future in batch.items():
            value = values.get(key)
            if cache:
                self.put(key, value)
            if not future.done():
                future.set_result(value)

    def _settle(self, batch: Mapping[K, asyncio.Future[V | None]]) -> None:
        """Stop offering this batch's loads to new callers (unless a `forget` already
        did, and a newer load has taken the key's place since)."""
        for key, future in batch.items():
            if self._loading.get(key) is future:
                del self._loading[key]
