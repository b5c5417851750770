"""Per-key limits across gateway processes: each publishes its counts of the limited
keys it served and reads the others' (`areal_service/store/key_counters.py`,
`gateway/limits.py`), on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio

import pytest

from areal_service.store import TrajectoryStore
from areal_service.store.key_counters import FORGET_AFTER_S
from areal_service.types import ApiKeyRecord, KeyCounts
from gateway.errors import OpenAIError
from gateway.limits import KeyLimits, sync_key_limits


def _key(store: TrajectoryStore, key_id: str = "k1", **limits: int) -> ApiKeyRecord:
    return store.keys.add_api_key(
        ApiKeyRecord(id=key_id, key_hash=f"hash-{key_id}", display="sk-…", **limits)
    )


def test_exchange_sums_the_other_fresh_holders(store: TrajectoryStore) -> None:
    engine = store.engine
    _key(store)
    store.keys.add_api_key_tokens({"k1": 500})
    mine = {"k1": KeyCounts(3, 30, 1, 7)}
    assert store.coordination.exchange_key_counts("a", mine, 5, now=100.0) == ({}, {"k1": 500})
    store.coordination.exchange_key_counts("b", {"k1": KeyCounts(2, 20, 2, 4)}, 5, now=101.0)
    store.coordination.exchange_key_counts(
        "c", {"k1": KeyCounts(1, 10, 0, 0)}, 5, now=90.0
    )  # stale
    peers, used = store.coordination.exchange_key_counts("a", mine, 5, now=102.0)
    assert peers == {"k1": KeyCounts(2, 20, 2, 4)} and used == {"k1": 500}
    peers, _ = store.coordination.exchange_key_counts("b", {"k1": KeyCounts()}, 5, now=103.0)
    assert peers == {"k1": KeyCounts(3, 30, 1, 7)}  # a's latest row, c's too old
    store.coordination.forget_key_counts("a")
    assert store.coordination.exchange_key_counts("b", {"k1": KeyCounts()}, 5, now=104.0)[0] == {}
    # an hour-old row is deleted by the next exchange
    store.coordination.exchange_key_counts(
        "z", {"k1": KeyCounts()}, 5, now=104.0 + FORGET_AFTER_S + 1
    )
    with engine.connect() as connection:
        holders = connection.exec_driver_sql("SELECT holder FROM key_counters").scalars().all()
    assert sorted(holders) == ["z"]


def test_limits_count_the_other_processes() -> None:
    now = [1000.0]
    limits = KeyLimits(clock=lambda: now[0])
    key = ApiKeyRecord(
        id="k1",
        key_hash="h",
        display="d",
        rpm_limit=5,
        max_concurrent=3,
        tpm_limit=100,
        token_budget=1000,
        tokens_used=0,
    )
    assert limits.admit(key)
    mine = limits.counts({})
    assert mine == {"k1": KeyCounts(1, 0, 1, 0)}
    limits.apply(mine, {"k1": KeyCounts(requests=4)}, {"k1": 0})
    with pytest.raises(OpenAIError) as exc:  # 1 here + 4 elsewhere = 5 a minute
        limits.admit(key)
    assert exc.value.status == 429 and exc.value.headers == {"retry-after": "60"}
    limits.apply(mine, {"k1": KeyCounts(in_flight=2)}, {"k1": 0})
    with pytest.raises(OpenAIError, match="3 requests in flight"):
        limits.admit(key)
    limits.apply(mine, {"k1": KeyCounts(tokens=100)}, {"k1": 0})
    with pytest.raises(OpenAIError, match="tokens per minute"):
        limits.admit(key)
    # the budget: stored total + this process's and the others' unflushed tokens
    limits.apply(
        {"k1": KeyCounts(unflushed_tokens=300)},
        {"k1": KeyCounts(unflushed_tokens=200)},
        {"k1": 500},
    )
    with pytest.raises(OpenAIError, match="token budget"):
        limits.admit(key)
    limits.apply(mine, {}, {"k1": 100})
    assert limits.admit(key)  # alone again
    now[0] += 200  # idle (nothing in flight once released): not published any more
    limits.release(key)
    limits.release(key)
    assert limits.counts({}) == {}


def test_two_processes_share_a_rate_limit(store: TrajectoryStore) -> None:
    """Two `KeyLimits` (two gateway processes) synced through the store: 3 requests a
    minute in all, not 3 each."""
    key = _key(store, rpm_limit=3)

    async def run() -> list[bool]:
        a, b = KeyLimits(), KeyLimits()
        tasks = [
            asyncio.create_task(sync_key_limits(limits, dict, store.coordination, name, 0.05))
            for limits, name in ((a, "a"), (b, "b"))
        ]
        try:
            admitted = [a.admit(key), a.admit(key), b.admit(key)]
            deadline = asyncio.get_running_loop().time() + 10
            while (a._keys[key.id].peers.requests, b._keys[key.id].peers.requests) != (1, 2):
                assert asyncio.get_running_loop().time() < deadline, "never synced"
                await asyncio.sleep(0.02)
            for limits in (a, b):
                try:
                    admitted.append(limits.admit(key))
                except OpenAIError:
                    admitted.append(False)
            return admitted
        finally:
            for task in tasks:
                task.cancel()

    assert asyncio.run(run()) == [True, True, True, False, False]
