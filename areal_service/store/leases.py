"""Named leases: one holder at a time, for work that must happen once per deployment
although several gateway processes (workers on one host, replicas on several) share the
store: weight swaps and idle-session sweeps (`gateway/leader.py`).

A lease is one row (name, holder, expires_at). `acquire_lease` is a single upsert that
takes the row when it is free or expired, or renews it for its own holder; the holder is
read back in the same transaction, so two processes racing for a free lease never both
win (SQLite serialises writers; PostgreSQL's ON CONFLICT DO UPDATE locks the row).

Expiry compares wall clocks of different processes: on one host that is one clock; across
hosts they must agree (NTP) to well within the lease's time to live. A holder that cannot
renew (database down) must assume it lost the lease at its own expiry (`gateway/leader.py`).
"""

from __future__ import annotations

import time

from sqlalchemy import Engine, delete, select
from sqlalchemy.dialects import postgresql, sqlite

from areal_service.store.schema import LeaseRow


def acquire_lease(
    engine: Engine, name: str, holder: str, ttl_s: float, *, now: float | None = None
) -> bool:
    """Take `name` for `holder` until now + `ttl_s` if it is free, expired or already
    theirs; True when `holder` holds it afterwards."""
    now = time.time() if now is None else now
    dialect = postgresql if engine.dialect.name == "postgresql" else sqlite
    upsert = dialect.insert(LeaseRow).values(name=name, holder=holder, expires_at=now + ttl_s)
    upsert = upsert.on_conflict_do_update(
        index_elements=[LeaseRow.name],
        set_={"holder": upsert.excluded.holder, "expires_at": upsert.excluded.expires_at},
        where=(LeaseRow.holder == holder) | (LeaseRow.expires_at < now),
    )
    with engine.begin() as connection:
        connection.execute(upsert)
        current = connection.execute(
            select(LeaseRow.holder).where(LeaseRow.name == name)
        ).scalar_one()
    return bool(current == holder)


def release_lease(engine: Engine, name: str, holder: str) -> None:
    """Give `name` up if `holder` has it (a clean shutdown: the next holder need not wait
    for the expiry)."""
    with engine.begin() as connection:
        connection.execute(delete(LeaseRow).where(LeaseRow.name == name, LeaseRow.holder == holder))


def lease_holder(engine: Engine, name: str, *, now: float | None = None) -> str | None:
    """Who holds `name` now (None: nobody, or expired)."""
    now = time.time() if now is None else now
    with engine.connect() as connection:
        row = connection.execute(
            select(LeaseRow.holder, LeaseRow.expires_at).where(LeaseRow.name == name)
        ).first()
    return None if row is None or row.expires_at < now else str(row.holder)
