"""Signed-out console cookies, shared by every gateway process on the store: a sign-out
served by one worker or replica is refused by all (`gateway/console/auth.py`). A row
lives until its cookie would have expired anyway; expired rows are deleted by the next
sign-out, so the table holds at most the sign-outs of one cookie lifetime.
"""

from __future__ import annotations

import time

from sqlalchemy import Engine, delete, select
from sqlalchemy.dialects import postgresql, sqlite

from areal_service.store.schema import ConsoleRevocationRow


def revoke_console_session(
    engine: Engine, nonce: str, expires_at: float, *, now: float | None = None
) -> None:
    """Refuse the cookie with `nonce` until `expires_at` (idempotent)."""
    now = time.time() if now is None else now
    dialect = postgresql if engine.dialect.name == "postgresql" else sqlite
    with engine.begin() as connection:
        connection.execute(
            delete(ConsoleRevocationRow).where(ConsoleRevocationRow.expires_at < now)
        )
        connection.execute(
            dialect.insert(ConsoleRevocationRow)
            .values(nonce=nonce, expires_at=expires_at)
            .on_conflict_do_nothing(index_elements=[ConsoleRevocationRow.nonce])
        )


def console_session_revoked(engine: Engine, nonce: str) -> bool:
    """Whether the cookie with `nonce` was signed out (one primary-key read)."""
    with engine.connect() as connection:
        return (
            connection.execute(
                select(ConsoleRevocationRow.nonce).where(ConsoleRevocationRow.nonce == nonce)
            ).first()
            is not None
        )
