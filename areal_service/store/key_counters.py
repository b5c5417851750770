"""Per-key counts shared by gateway processes: each process (`holder`) publishes its own
counts of the keys with limits it served lately and reads the others' in the same
transaction, every `gateway.limits.key_limits_sync_s` (`gateway/limits.py`). One row per
(key, holder); rows not updated within `fresh_s` belong to gone processes: they count
for nothing and are deleted once an hour old.

Why not one shared counter per key: a write per request to a hot row serialises every
process on its lock; a publish per process per second costs one short transaction
whatever the load, and bounds how far N processes together can pass a limit to what
they admit within one sync interval.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping

from sqlalchemy import Engine, delete, func, select
from sqlalchemy.dialects import postgresql, sqlite

from areal_service.store.schema import ApiKeyRow, KeyCounterRow
from areal_service.types import KeyCounts

FORGET_AFTER_S = 3600.0
"""Rows of holders silent this long are deleted."""


def exchange_key_counts(
    engine: Engine,
    holder: str,
    counts: Mapping[str, KeyCounts],
    fresh_s: float,
    *,
    now: float | None = None,
) -> tuple[dict[str, KeyCounts], dict[str, int]]:
    """Publish `holder`'s `counts` (key id -> counts; keys left out are not touched) and
    return, for those keys, the other holders' fresh counts summed and the stored
    `tokens_used`."""
    now = time.time() if now is None else now
    if not counts:
        return {}, {}
    dialect = postgresql if engine.dialect.name == "postgresql" else sqlite
    rows = [
        {
            "key_id": key_id,
            "holder": holder,
            "requests": c.requests,
            "tokens": c.tokens,
            "in_flight": c.in_flight,
            "unflushed_tokens": c.unflushed_tokens,
            "updated_at": now,
        }
        for key_id, c in sorted(counts.items())
    ]  # lock order
    upsert = dialect.insert(KeyCounterRow)
    upsert = upsert.on_conflict_do_update(
        index_elements=[KeyCounterRow.key_id, KeyCounterRow.holder],
        set_={
            name: getattr(upsert.excluded, name)
            for name in ("requests", "tokens", "in_flight", "unflushed_tokens", "updated_at")
        },
    )
    keys = list(counts)
    with engine.begin() as connection:
        connection.execute(upsert, rows)
        peers = connection.execute(
            select(
                KeyCounterRow.key_id,
                func.sum(KeyCounterRow.requests),
                func.sum(KeyCounterRow.tokens),
                func.sum(KeyCounterRow.in_flight),
                func.sum(KeyCounterRow.unflushed_tokens),
            )
            .where(
                KeyCounterRow.key_id.in_(keys),
                KeyCounterRow.holder != holder,
                KeyCounterRow.updated_at >= now - fresh_s,
            )
            .group_by(KeyCounterRow.key_id)
        ).all()
        used = connection.execute(
            select(ApiKeyRow.id, ApiKeyRow.tokens_used).where(ApiKeyRow.id.in_(keys))
        ).all()
        connection.execute(
            delete(KeyCounterRow).where(KeyCounterRow.updated_at < now - FORGET_AFTER_S)
        )
    return (
        {key_id: KeyCounts(int(r), int(t), int(f), int(u)) for key_id, r, t, f, u in peers},
        {key_id: int(n or 0) for key_id, n in used},
    )


def forget_key_counts(engine: Engine, holder: str, key_ids: Collection[str] | None = None) -> None:
    """Delete `holder`'s rows (all, or those keys'): a process stopping cleanly."""
    statement = delete(KeyCounterRow).where(KeyCounterRow.holder == holder)
    if key_ids is not None:
        statement = statement.where(KeyCounterRow.key_id.in_(list(key_ids)))
    with engine.begin() as connection:
        connection.execute(statement)
