"""Named leases (`areal_service/store/leases.py`) on SQLite and PostgreSQL: one holder at
a time, renewal by the holder, takeover only after expiry, release; and many threads
racing for a free lease elect exactly one."""

from __future__ import annotations

import threading

from areal_service.store import TrajectoryStore


def test_one_holder_until_expiry_or_release(store: TrajectoryStore) -> None:
    leases = store.coordination
    assert leases.acquire_lease("leader", "a", 10, now=100.0)
    assert not leases.acquire_lease("leader", "b", 10, now=105.0)  # a holds it until 110
    assert leases.lease_holder("leader", now=105.0) == "a"
    assert leases.acquire_lease("leader", "a", 10, now=108.0)  # renewed: until 118
    assert not leases.acquire_lease("leader", "b", 10, now=115.0)
    assert leases.acquire_lease("leader", "b", 10, now=118.5)  # a's lapsed
    assert leases.lease_holder("leader", now=119.0) == "b"
    assert leases.lease_holder("leader", now=129.0) is None  # b's lapsed too
    assert leases.lease_holder("other") is None
    store.coordination.release_lease("leader", "a")  # not a's any more: no effect
    assert leases.lease_holder("leader", now=119.0) == "b"
    store.coordination.release_lease("leader", "b")
    assert store.coordination.lease_holder("leader") is None
    assert store.coordination.acquire_lease("leader", "c", 10)


def test_racing_processes_elect_exactly_one(store: TrajectoryStore) -> None:
    winners: list[str] = []
    barrier = threading.Barrier(8)

    def contend(name: str) -> None:
        barrier.wait()
        if store.coordination.acquire_lease("leader", name, 30):
            winners.append(name)

    threads = [threading.Thread(target=contend, args=(f"p{i}",)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(winners) == 1
    assert store.coordination.lease_holder("leader") == winners[0]
