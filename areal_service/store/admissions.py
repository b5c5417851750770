"""Staleness-window admissions shared by every gateway process on the store (workers on
one host, replicas on several): the window is one count in the database, so two
processes must never both take its last place.

`reserve_admission` counts the admitted sessions plus the places other processes hold
for sessions they are about to insert (`admissions` rows) and, when there is room, adds
a row of its own; all in one transaction that the processes take one at a time
(SQLite: its first statement is a write, which takes the database's write lock before
anything is counted; PostgreSQL: a transaction-scoped advisory lock). Each session
inserted under the reservation takes one place from the row in the insert's own
transaction (`take_admitted_place`), so a place is counted exactly once at every
commit: held, then admitted. Both counts are read in one statement (one snapshot on
PostgreSQL, where inserts do not wait for the advisory lock). `release_admission`
deletes the row with what is left (sessions never inserted). A process that dies in
between leaves a row that stops counting at its `expires_at` (and is deleted by the
next reservation).

Per policy (`policies:`): a reservation made for a policy counts only that policy's
admitted sessions and reservations, and holds its places in that policy's window
(`admissions.policy`). Without a policy it counts every session and reservation, which
is today's single window. All windows share the one lock: a reservation is short, and
one lock keeps the rule "one reserving transaction at a time" simple on both dialects.

Per key (`KeyShare`): a user key's reservation also counts that key's sessions in flight
(open, ended or claimed: not yet trained or dropped) in the policy plus its live
reservations, and is refused (`KeyShareFull`) past the key's limit, in the same
transaction: one key's refreshes cannot fill the whole window and leave its co-tenants
(and the admin) at 429 until a trainer drains it.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from sqlalchemy import Connection, Engine, delete, func, insert, select, update

from areal_service.store.schema import AdmissionRow, SessionRow

ADMISSION_LOCK_ID = 0x4152_4541_4C47
"""PostgreSQL advisory lock key of the admission transaction ("AREALG")."""

IN_FLIGHT = ("open", "ended", "claimed")
"""A key's sessions that hold places of its share: not yet trained, nor dropped."""


@dataclass(frozen=True, slots=True)
class KeyShare:
    """A user key's part of a window: at most `limit` of its sessions in flight."""

    key_id: str
    limit: int


class KeyShareFull(Exception):
    """The key already holds `held` of its `limit` places."""

    def __init__(self, held: int, limit: int) -> None:
        super().__init__(f"key holds {held} of its {limit} places")
        self.held = held
        self.limit = limit


def reserve_admission(
    engine: Engine,
    count: int,
    limit: int,
    ttl_s: float,
    *,
    now: float | None = None,
    policy: str | None = None,
    key: KeyShare | None = None,
) -> tuple[str | None, int]:
    """Hold `count` places in a window of `limit` until `release_admission` or
    now + `ttl_s`: (the reservation's id, or None when there is no room; the places
    taken before this call: admitted sessions plus live reservations). `policy`: that
    policy's window (its sessions and reservations only); None: the one shared window
    of every session. `key`: a user key's share of it (KeyShareFull past it)."""
    now = time.time() if now is None else now
    with engine.begin() as connection:
        if connection.dialect.name == "postgresql":
            connection.execute(select(func.pg_advisory_xact_lock(ADMISSION_LOCK_ID)))
        # A write first: on SQLite this takes the write lock, so the counts below stay
        # true until the commit.
        connection.execute(delete(AdmissionRow).where(AdmissionRow.expires_at < now))
        sessions = (
            select(func.count()).select_from(SessionRow).where(SessionRow.status != "dropped")
        )
        places = select(func.coalesce(func.sum(AdmissionRow.count), 0))
        if policy is not None:  # sessions.policy is indexed
            sessions = sessions.where(SessionRow.policy == policy)
            places = places.where(AdmissionRow.policy == policy)
        if key is not None:
            _check_key_share(connection, key, count, policy)
        admitted, held = sessions.scalar_subquery(), places.scalar_subquery()
        taken = int(connection.execute(select(admitted + held)).scalar_one())
        if taken + count > limit:
            return None, taken
        reservation = uuid.uuid4().hex
        connection.execute(
            insert(AdmissionRow).values(
                id=reservation,
                count=count,
                expires_at=now + ttl_s,
                api_key_id=None if key is None else key.key_id,
                **({} if policy is None else {"policy": policy}),
            )
        )
    return reservation, taken


def _check_key_share(connection: Connection, key: KeyShare, count: int, policy: str | None) -> None:
    """KeyShareFull when `key`'s sessions in flight and live reservations (in `policy`'s
    window) leave no room for `count` more (one index range on (api_key_id, status))."""
    sessions = (
        select(func.count())
        .select_from(SessionRow)
        .where(SessionRow.api_key_id == key.key_id, SessionRow.status.in_(IN_FLIGHT))
    )
    places = select(func.coalesce(func.sum(AdmissionRow.count), 0)).where(
        AdmissionRow.api_key_id == key.key_id
    )
    if policy is not None:
        sessions = sessions.where(SessionRow.policy == policy)
        places = places.where(AdmissionRow.policy == policy)
    held = int(
        connection.execute(
            select(sessions.scalar_subquery() + places.scalar_subquery())
        ).scalar_one()
    )
    if held + count > key.limit:
        raise KeyShareFull(held, key.limit)


def take_admitted_place(connection: Connection, reservation: str) -> None:
    """In the transaction that inserts a session admitted under `reservation`: move one
    place from the reservation to the session."""
    connection.execute(
        update(AdmissionRow)
        .where(AdmissionRow.id == reservation, AdmissionRow.count > 0)
        .values(count=AdmissionRow.count - 1)
    )


def release_admission(engine: Engine, reservation: str) -> None:
    """Give back the places its sessions did not take (all of them, if none was
    inserted)."""
    with engine.begin() as connection:
        connection.execute(delete(AdmissionRow).where(AdmissionRow.id == reservation))
