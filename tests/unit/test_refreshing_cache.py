"""RefreshingCache on a real store (SQLite and PostgreSQL): stale and missing entries
are reloaded in one batched store read, concurrent callers share it, a `forget` during a
read keeps its result out of the cache, and a failed read reaches its callers only."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Collection, Mapping

import pytest

from areal_service.store import TrajectoryStore
from areal_service.types import ApiKeyRecord, SessionRecord
from gateway.cache import MAX_BATCH, RefreshingCache


class CountingReads:
    """Wraps a batched store read: how many reads, and which keys each asked for."""

    def __init__(self, read: Callable[[Collection[str]], Mapping[str, object]]) -> None:
        self.read = read
        self.calls: list[list[str]] = []

    def __call__(self, keys: list[str]) -> Mapping[str, object]:
        self.calls.append(sorted(keys))
        return self.read(keys)


def add_keys(store: TrajectoryStore, n: int) -> list[ApiKeyRecord]:
    keys = [ApiKeyRecord(id=f"key-{i}", key_hash=f"{i:064x}", display=f"k{i}") for i in range(n)]
    for key in keys:
        store.keys.add_api_key(key)
    return keys


async def settle(cache: RefreshingCache[str, object]) -> None:
    """Wait until no batch is being read."""
    while cache._batcher is not None:
        await asyncio.sleep(0.005)


async def test_stale_keys_reload_in_one_store_read(store: TrajectoryStore):
    keys = add_keys(store, 40)
    reads = CountingReads(store.keys.find_api_keys_by_hashes)
    cache: RefreshingCache[str, object] = RefreshingCache(reads, ttl_s=0.0, stale_s=60.0)
    for key in keys:
        cache.put(key.key_hash, key)  # created here: cached, and stale at once (ttl 0)
    store.keys.revoke_api_key("key-7", at=1_700_000_000.0)  # another replica's change
    served = await asyncio.gather(*(cache.get(key.key_hash) for key in keys))
    assert served == keys  # stale values served without waiting
    await settle(cache)
    assert reads.calls == [sorted(key.key_hash for key in keys)]  # one read for all 40
    assert cache.peek(keys[7].key_hash).revoked_at == 1_700_000_000.0


async def test_misses_share_one_read_and_unknown_is_none(store: TrajectoryStore):
    keys = add_keys(store, 5)
    store.add_session(SessionRecord(id="s1", created_at=1.0, last_activity_at=1.0))
    reads = CountingReads(store.keys.find_api_keys_by_hashes)
    cache: RefreshingCache[str, object] = RefreshingCache(reads, ttl_s=5.0, stale_s=60.0)
    wanted = [key.key_hash for key in keys] + ["ff" * 32]
    got = await asyncio.gather(*(cache.get(h) for h in wanted + wanted))
    assert got == keys + [None] + keys + [None]
    assert len(reads.calls) == 1
    assert await cache.get(keys[0].key_hash) == keys[0] and len(reads.calls) == 1  # fresh

    sessions = CountingReads(store.get_sessions)
    session_cache: RefreshingCache[str, object] = RefreshingCache(sessions, ttl_s=1.0, stale_s=30.0)
    assert [
        s and s.id for s in await asyncio.gather(session_cache.get("s1"), session_cache.get("nope"))
    ] == ["s1", None]
    assert sessions.calls == [["nope", "s1"]]


async def test_a_batch_is_bounded_and_keys_queued_meanwhile_go_next(store: TrajectoryStore):
    reads = CountingReads(store.keys.find_api_keys_by_hashes)
    cache: RefreshingCache[str, object] = RefreshingCache(reads, ttl_s=5.0, stale_s=60.0)
    hashes = [f"{i:064x}" for i in range(MAX_BATCH + 3)]
    assert await asyncio.gather(*(cache.get(h) for h in hashes)) == [None] * len(hashes)
    assert [len(call) for call in reads.calls] == [MAX_BATCH, 3]


async def test_forget_during_a_read_keeps_its_result_out(store: TrajectoryStore):
    (key,) = add_keys(store, 1)
    entered, release = threading.Event(), threading.Event()

    def slow_read(hashes: Collection[str]) -> Mapping[str, ApiKeyRecord]:
        entered.set()
        release.wait(10)
        return store.keys.find_api_keys_by_hashes(hashes)

    cache: RefreshingCache[str, object] = RefreshingCache(slow_read, ttl_s=5.0, stale_s=60.0)
    first = asyncio.ensure_future(cache.get(key.key_hash))
    await asyncio.to_thread(entered.wait, 10)
    cache.forget(key.key_hash)  # e.g. a revoke through this process
    release.set()
    assert await first == key  # its caller still gets what was read
    assert cache.peek(key.key_hash) is None  # but it is not cached


async def test_a_failed_read_reaches_its_callers_and_the_next_get_retries(store: TrajectoryStore):
    (key,) = add_keys(store, 1)
    failures = [RuntimeError("database briefly unavailable")]

    def flaky_read(hashes: Collection[str]) -> Mapping[str, ApiKeyRecord]:
        if failures:
            raise failures.pop()
        return store.keys.find_api_keys_by_hashes(hashes)

    cache: RefreshingCache[str, object] = RefreshingCache(flaky_read, ttl_s=5.0, stale_s=60.0)
    results = await asyncio.gather(
        cache.get(key.key_hash), cache.get(key.key_hash), return_exceptions=True
    )
    assert [type(r) for r in results] == [RuntimeError, RuntimeError]
    assert await cache.get(key.key_hash) == key


async def test_a_cancelled_caller_does_not_cancel_the_read_for_others(store: TrajectoryStore):
    (key,) = add_keys(store, 1)
    cache: RefreshingCache[str, object] = RefreshingCache(
        store.keys.find_api_keys_by_hashes, ttl_s=5.0, stale_s=60.0
    )
    leaving = asyncio.ensure_future(cache.get(key.key_hash))
    staying = asyncio.ensure_future(cache.get(key.key_hash))
    await asyncio.sleep(0)
    leaving.cancel()
    assert await staying == key
    with pytest.raises(asyncio.CancelledError):
        await leaving
