"""Failed-credential counts shared by gateway processes, so the auth throttle
(`gateway/throttle.py`) locks a client address out on every process's failures, not on
each process's own. Each process (`holder`) publishes its counts of the addresses whose
count changed since its last publish, and reads the others' sums, once every
`gateway.auth.throttle_sync_s`. One row per (address, holder).

Why not one shared row per address written on every failure: that would hand the
store's write lock to whoever sends bad keys. Here a process writes at most once per
sync interval however many guesses it refuses, and nothing at all while none fail.
Rows whose last failure and lock-out both ended more than `quiet_s` ago count for
nothing (the throttle has forgotten them too) and are deleted by the next publish.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from sqlalchemy import Engine, and_, delete, func, or_, select
from sqlalchemy.dialects import postgresql, sqlite

from areal_service.store.schema import AuthFailureRow
from areal_service.types import AuthFailures


def exchange_auth_failures(
    engine: Engine,
    holder: str,
    mine: Mapping[str, AuthFailures],
    quiet_s: float,
    *,
    limit: int,
    now: float | None = None,
) -> dict[str, AuthFailures]:
    """Publish `holder`'s counts (`mine`: address -> counts; addresses left out are not
    touched) and return the other holders' live counts per address: failures summed,
    the latest failure and lock-out. At most `limit` addresses, the most recent first.
    Read-only (no write transaction) when `mine` is empty."""
    now = time.time() if now is None else now
    live = or_(
        AuthFailureRow.last_failure >= now - quiet_s, AuthFailureRow.locked_until >= now - quiet_s
    )
    latest = func.max(AuthFailureRow.last_failure)
    peers = (
        select(
            AuthFailureRow.address,
            func.sum(AuthFailureRow.failures),
            latest,
            func.max(AuthFailureRow.locked_until),
        )
        .where(AuthFailureRow.holder != holder, live)
        .group_by(AuthFailureRow.address)
        .order_by(latest.desc())
        .limit(limit)
    )
    if not mine:
        with engine.connect() as connection:
            rows = connection.execute(peers).all()
    else:
        dialect = postgresql if engine.dialect.name == "postgresql" else sqlite
        upsert = dialect.insert(AuthFailureRow)
        upsert = upsert.on_conflict_do_update(
            index_elements=[AuthFailureRow.address, AuthFailureRow.holder],
            set_={
                name: getattr(upsert.excluded, name)
                for name in ("failures", "last_failure", "locked_until")
            },
        )
        values = [
            {
                "address": address,
                "holder": holder,
                "failures": f.failures,
                "last_failure": f.last_failure,
                "locked_until": f.locked_until,
            }
            for address, f in sorted(mine.items())
        ]  # one lock order for all
        with engine.begin() as connection:
            connection.execute(upsert, values)
            rows = connection.execute(peers).all()
            connection.execute(
                delete(AuthFailureRow).where(
                    and_(
                        AuthFailureRow.last_failure < now - quiet_s,
                        AuthFailureRow.locked_until < now - quiet_s,
                    )
                )
            )
    return {
        address: AuthFailures(int(n), float(last), float(locked))
        for address, n, last, locked in rows
    }
