"""KeyResolver: cached lookups, one store query for concurrent misses of a key, keys
this process created need no query, and a revoke (`forget`) is never undone by a lookup
that was already in flight."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Collection
from pathlib import Path

import pytest

from areal_service.config import StoreConfig
from areal_service.keys import new_api_key
from areal_service.store import KeyStore, TrajectoryStore
from areal_service.types import ApiKeyRecord
from gateway.auth import KeyResolver
from gateway.errors import OpenAIError


class CountingKeys(KeyStore):
    """The real SQLite key store, counting key lookups (batched: the resolver's cache
    reads every key it needs in one); `gate` holds a lookup open after
    it read the row (so a revoke can land between the read and the caching)."""

    lookups: int
    gate: threading.Event | None
    read: threading.Event
    fail: Exception | None

    def find_api_keys_by_hashes(self, key_hashes: Collection[str]) -> dict[str, ApiKeyRecord]:
        self.lookups += 1
        if self.fail is not None:
            raise self.fail
        found = super().find_api_keys_by_hashes(key_hashes)
        self.read.set()
        if self.gate is not None:
            assert self.gate.wait(5)
        return found


@pytest.fixture
def store(tmp_path: Path):
    opened = TrajectoryStore.open(f"sqlite:///{tmp_path / 'keys.db'}", StoreConfig())
    keys = opened.keys = CountingKeys(opened.engine)
    keys.lookups, keys.gate, keys.read, keys.fail = 0, None, threading.Event(), None
    yield opened
    opened.close()


async def test_concurrent_misses_share_one_lookup(store: TrajectoryStore):
    plaintext, record = new_api_key(name="agent")
    store.keys.add_api_key(record)
    resolver = KeyResolver(store, "admin")
    principals = await asyncio.gather(*(resolver.resolve(plaintext) for _ in range(32)))
    assert {p.key_id for p in principals} == {record.id}
    assert store.keys.lookups == 1
    await resolver.resolve(plaintext)
    assert store.keys.lookups == 1  # cached


async def test_remembered_key_needs_no_lookup(store: TrajectoryStore):
    plaintext, record = new_api_key(name="session", kind="session")
    store.keys.add_api_key(record)
    resolver = KeyResolver(store, "admin")
    resolver.remember(record)
    assert (await resolver.resolve(plaintext)).key_id == record.id
    assert store.keys.lookups == 0


async def test_forget_during_a_lookup_is_not_undone(store: TrajectoryStore):
    plaintext, record = new_api_key(name="agent")
    store.keys.add_api_key(record)
    resolver = KeyResolver(store, "admin")
    store.keys.gate = threading.Event()
    first = asyncio.create_task(resolver.resolve(plaintext))
    assert await asyncio.to_thread(store.keys.read.wait, 5)
    store.keys.revoke_api_key(record.id)
    resolver.forget(record.key_hash)  # what the revoke route does
    store.keys.gate.set()
    assert (await first).key_id == record.id  # read before the revoke committed
    with pytest.raises(OpenAIError) as raised:
        await resolver.resolve(plaintext)
    assert raised.value.status == 401
    assert store.keys.lookups == 2


async def test_unknown_key_is_401_and_a_failed_lookup_reaches_every_waiter(store: TrajectoryStore):
    resolver = KeyResolver(store, "admin")
    with pytest.raises(OpenAIError) as raised:
        await resolver.resolve("sk-areal-unknown")
    assert raised.value.status == 401
    store.keys.fail = RuntimeError("database gone")
    results = await asyncio.gather(
        *(resolver.resolve("sk-areal-other") for _ in range(3)), return_exceptions=True
    )
    assert [type(r) for r in results] == [RuntimeError] * 3
    assert store.keys.lookups == 2  # one for the unknown key, one shared by the three
    store.keys.fail = None
    with pytest.raises(OpenAIError):  # the failure was not cached
        await resolver.resolve("sk-areal-other")
    assert store.keys.lookups == 3


async def test_stale_entries_are_served_while_one_reload_runs(store: TrajectoryStore):
    """Past `ttl_s` a known key is answered at once from the cache while one background
    reload reads the store; a revoke by another replica (no `forget` here) is seen once
    that reload lands. Past `stale_s` a lookup waits for the store again."""
    plaintext, record = new_api_key(name="agent")
    store.keys.add_api_key(record)
    resolver = KeyResolver(store, "admin", ttl_s=0.05, stale_s=0.5)
    resolver.remember(record)
    await asyncio.sleep(0.06)  # stale now
    store.keys.revoke_api_key(record.id)  # another replica revokes it
    store.keys.gate = threading.Event()  # the reload blocks after reading the row
    served = await asyncio.gather(*(resolver.resolve(plaintext) for _ in range(8)))
    assert {p.key_id for p in served} == {record.id}  # from the cache, no waiting
    assert await asyncio.to_thread(store.keys.read.wait, 5)
    assert store.keys.lookups == 1  # one reload for all eight
    store.keys.gate.set()
    for _ in range(200):  # until the reload lands (a few ms)
        try:
            await resolver.resolve(plaintext)
        except OpenAIError as revoked:
            assert revoked.status == 401
            break
        await asyncio.sleep(0.01)
    else:
        pytest.fail("the revoke was never seen")
    assert store.keys.lookups == 1

    plaintext2, record2 = new_api_key(name="agent2")
    store.keys.add_api_key(record2)
    store.keys.gate = None
    resolver.remember(record2)
    await asyncio.sleep(0.6)  # past stale_s: the lookup waits for the store
    before = store.keys.lookups
    store.keys.revoke_api_key(record2.id)
    with pytest.raises(OpenAIError):
        await resolver.resolve(plaintext2)
    assert store.keys.lookups == before + 1
