"""Named leases (`areal_service/store/leases.py`) on SQLite and PostgreSQL: one holder at
a time, renewal by the holder, takeover only after expiry, release; and many threads
racing for a free lease elect exactly one."""

from __future__ import annotations

import threading

from areal_service.store import TrajectoryStore
from areal_service.store.leases import acquire_lease, lease_holder


def test_one_holder_until_expiry_or_release(store: TrajectoryStore) -> None:
    engine = store.engine
    assert acquire_lease(engine, "leader", "a", 10, now=100.0)
    assert not acquire_lease(engine, "leader", "b", 10, now=105.0)  # a holds it until 110
    assert lease_holder(engine, "leader", now=105.0) == "a"
    assert acquire_lease(engine, "leader", "a", 10, now=108.0)  # renewed: until 118
    assert not acquire_lease(engine, "leader", "b", 10, now=115.0)
    assert acquire_lease(engine, "leader", "b", 10, now=118.5)  # a's lapsed
    assert lease_holder(engine, "leader", now=119.0) == "b"
    assert lease_holder(engine, "leader", now=129.0) is None  # b's lapsed too
    assert lease_holder(engine, "other") is None
    store.release_lease("leader", "a")  # not a's any more: no effect
    assert lease_holder(engine, "leader", now=119.0) == "b"
    store.release_lease("leader", "b")
    assert store.lease_holder("leader") is None
    assert store.acquire_lease("leader", "c", 10)


def test_racing_processes_elect_exactly_one(store: TrajectoryStore) -> None:
    winners: list[str] = []
    barrier = threading.Barrier(8)

    def contend(name: str) -> None:
        barrier.wait()
        if store.acquire_lease("leader", name, 30):
            winners.append(name)

    threads = [threading.Thread(target=contend, args=(f"p{i}",)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(winners) == 1
    assert store.lease_holder("leader") == winners[0]
