"""Gates every gateway process on one store agrees on, on SQLite and PostgreSQL:
staleness-window reservations (`areal_service/store/admissions.py`) that many
processes racing for the last places never overshoot, that lapse when their holder dies,
console sign-outs (`areal_service/store/revocations.py`) seen by every process, and
failed-credential counts summed over the processes
(`areal_service/store/auth_failures.py`)."""

from __future__ import annotations

import threading

from sqlalchemy import select

from areal_service.config import StoreConfig
from areal_service.store import TrajectoryStore
from areal_service.store.schema import AuthFailureRow
from areal_service.types import AuthFailures, SessionRecord


def test_reservations_count_until_released_or_expired(store: TrajectoryStore) -> None:
    first, taken = store.coordination.reserve_admission(2, 4, 10, now=100.0)
    assert first is not None and taken == 0
    store.add_session(SessionRecord(id="s1"))
    assert store.coordination.reserve_admission(2, 4, 10, now=105.0) == (None, 3)  # 1 + 2 held
    store.coordination.release_admission(first)
    second, taken = store.coordination.reserve_admission(2, 4, 10, now=105.0)
    assert second is not None and taken == 1
    # Its holder died: the places come back at its expiry (115), not before.
    assert store.coordination.reserve_admission(2, 4, 10, now=114.0)[0] is None
    third, taken = store.coordination.reserve_admission(3, 4, 10, now=115.5)
    assert third is not None and taken == 1


def test_a_session_takes_its_place_from_its_reservation(store: TrajectoryStore) -> None:
    """Inserted under its reservation, a session's place is counted once: held, then
    admitted (never both, so concurrent starts are not refused for nothing)."""
    reservation, taken = store.coordination.reserve_admission(2, 4, 10, now=100.0)
    assert reservation is not None and taken == 0
    store.add_session(SessionRecord(id="s1"), reservation)
    assert store.coordination.reserve_admission(3, 4, 10, now=101.0) == (
        None,
        2,
    )  # 1 admitted + 1 held
    store.add_session(SessionRecord(id="s2"), reservation)
    assert store.coordination.reserve_admission(3, 4, 10, now=101.0) == (None, 2)  # 2 admitted
    store.coordination.release_admission(reservation)
    second, taken = store.coordination.reserve_admission(2, 4, 10, now=102.0)
    assert second is not None and taken == 2


def test_racing_processes_never_overshoot_the_window(store_url: str) -> None:
    """Eight processes (each its own engine and connections) admit and insert sessions
    as fast as they can into a window of 12: exactly 12 get in."""
    limit, admitted = 12, []
    barrier = threading.Barrier(8)
    errors: list[BaseException] = []

    def process(name: str) -> None:
        own = stores[name]
        try:
            barrier.wait(timeout=60)
            for i in range(6):
                reservation, _ = own.coordination.reserve_admission(1, limit, 30)
                if reservation is None:
                    continue
                own.add_session(SessionRecord(id=f"{name}-{i}"))
                admitted.append(name)
                own.coordination.release_admission(reservation)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the test below
            errors.append(exc)
            barrier.abort()

    stores = {f"p{i}": TrajectoryStore.open(store_url, StoreConfig()) for i in range(8)}
    threads = [threading.Thread(target=process, args=(f"p{i}",)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for own in stores.values():
        own.close()
    assert not errors, errors
    assert len(admitted) == limit
    check = TrajectoryStore.open(store_url, StoreConfig())
    try:
        assert check.count_admitted_sessions() == limit
    finally:
        check.close()


def test_each_policys_reservations_hold_places_in_its_own_window(
    store: TrajectoryStore,
) -> None:
    """Per policy, a reservation counts only that policy's admitted sessions and held
    places; without a policy it counts everything (the single window)."""
    reserve = store.coordination.reserve_admission
    solver, taken = reserve(2, 2, 10, now=100.0, policy="solver")
    assert solver is not None and taken == 0
    assert reserve(1, 2, 10, now=100.0, policy="solver") == (None, 2)  # its places held
    verifier, taken = reserve(2, 2, 10, now=100.0, policy="verifier")
    assert verifier is not None and taken == 0  # another window
    store.add_session(SessionRecord(id="s1", policy="solver"), solver)
    store.coordination.release_admission(solver)
    assert reserve(2, 2, 10, now=101.0, policy="solver") == (None, 1)  # 1 admitted
    assert reserve(1, 2, 10, now=101.0, policy="verifier") == (None, 2)
    assert reserve(4, 4, 10, now=101.0) == (None, 3)  # no policy: 1 admitted + 2 held
    assert reserve(1, 1, 10, now=101.0, policy="default")[1] == 0


def test_racing_processes_fill_each_policys_window_exactly(store_url: str) -> None:
    """Eight processes, each admitting sessions of two policies in turn as fast as it
    can, into windows of 5 and 7: exactly 5 and 7 get in (one transaction per
    reservation across processes, per policy)."""
    limits = {"solver": 5, "verifier": 7}
    admitted: list[str] = []
    barrier = threading.Barrier(8)
    errors: list[BaseException] = []

    def process(name: str) -> None:
        own = stores[name]
        try:
            barrier.wait(timeout=60)
            for i in range(4):
                for policy, limit in limits.items():
                    reservation, _ = own.coordination.reserve_admission(1, limit, 30, policy=policy)
                    if reservation is None:
                        continue
                    own.add_session(
                        SessionRecord(id=f"{name}-{policy}-{i}", policy=policy), reservation
                    )
                    admitted.append(policy)
                    own.coordination.release_admission(reservation)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the test below
            errors.append(exc)
            barrier.abort()

    stores = {f"p{i}": TrajectoryStore.open(store_url, StoreConfig()) for i in range(8)}
    threads = [threading.Thread(target=process, args=(f"p{i}",)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for own in stores.values():
        own.close()
    assert not errors, errors
    assert {p: admitted.count(p) for p in limits} == limits


def test_a_sign_out_is_seen_by_every_process(store_url: str) -> None:
    one = TrajectoryStore.open(store_url, StoreConfig())
    other = TrajectoryStore.open(store_url, StoreConfig())
    try:
        assert not other.coordination.console_session_revoked("n1")
        one.coordination.revoke_console_session("n1", expires_at=2e9)
        one.coordination.revoke_console_session("n1", expires_at=2e9)  # twice: idempotent
        assert other.coordination.console_session_revoked("n1")
        # Rows past their cookie's lifetime are deleted by the next sign-out.
        one.coordination.revoke_console_session("old", expires_at=50.0, now=10.0)
        one.coordination.revoke_console_session("n2", expires_at=500.0, now=100.0)
        assert not other.coordination.console_session_revoked("old")
        assert other.coordination.console_session_revoked("n1")
    finally:
        one.close()
        other.close()


def test_auth_failures_are_summed_over_the_other_processes(store: TrajectoryStore) -> None:
    engine, t = store.engine, 1_000_000.0

    def exchange(
        holder: str, mine: dict[str, AuthFailures], at: float, limit: int = 100
    ) -> dict[str, AuthFailures]:
        return store.coordination.exchange_auth_failures(holder, mine, 300, limit, now=t + at)

    assert exchange("p1", {"a": AuthFailures(3, t, 0.0)}, 0) == {}
    assert exchange(
        "p2", {"a": AuthFailures(2, t + 1, t + 11), "b": AuthFailures(1, t + 1, 0.0)}, 1
    ) == {"a": AuthFailures(3, t, 0.0)}
    assert exchange("p3", {}, 2) == {
        "a": AuthFailures(5, t + 1, t + 11),  # a read only
        "b": AuthFailures(1, t + 1, 0.0),
    }
    exchange("p1", {"a": AuthFailures(4, t + 3, t + 13)}, 3)  # p1's row is replaced
    assert exchange("p3", {}, 3)["a"] == AuthFailures(6, t + 3, t + 13)
    assert list(exchange("p3", {}, 3, limit=1)) == ["a"]  # the most recent first
    # Quiet for longer than the longest lock-out: counts for nothing, then deleted.
    assert exchange("p3", {}, 400) == {}
    assert exchange("p3", {"c": AuthFailures(1, t + 400, 0.0)}, 400) == {}
    with engine.connect() as connection:
        assert connection.execute(select(AuthFailureRow.address)).scalars().all() == ["c"]
