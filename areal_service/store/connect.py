"""Engine creation for the trajectory store: SQLite pragmas (WAL, synchronous, busy
timeout, foreign keys) and pooling, or a PostgreSQL engine; and `upgrade_database`
(`areal-service db upgrade`). Touches no rows.
"""

from __future__ import annotations

from typing import Any, Literal

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url

from areal_service.store.migrate import upgrade_engine

SQLITE_BUSY_TIMEOUT_MS = 30_000
"""How long a SQLite writer waits for another process's write lock before failing."""
def create_store_engine(
    url: str, *, sqlite_synchronous: Literal["OFF", "NORMAL", "FULL"] = "NORMAL"
) -> Engine:
    """An engine for `url`. SQLite connections get WAL, `synchronous`, a busy timeout and
    foreign keys on every connect; an in-memory SQLite is refused because every pooled
    connection (the writer thread has its own) would see a different empty database."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return create_engine(parsed, pool_pre_ping=True)
    if parsed.database in (None, "", ":memory:") or parsed.query.get("mode") == "memory":
        raise ValueError(f"store url {url!r}: use a SQLite file, not an in-memory database")
    if sqlite_synchronous not in ("OFF", "NORMAL", "FULL"):
        raise ValueError(f"store.sqlite_synchronous={sqlite_synchronous!r}")
    # Connections are made on demand; 10 kept covers the gateway's default thread pool
    # (cpu + 4 workers) and the sweeper, so none is closed on return and reopened (with
    # the pragmas below) under load, as overflow connections past SQLAlchemy's 5 were.
    engine = create_engine(parsed, pool_size=10, max_overflow=20)

    @event.listens_for(engine, "connect")
    def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        # WAL: readers never block the writer; with synchronous=NORMAL a commit survives
        # a process crash (FULL also survives power loss, one fsync per commit).
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA synchronous={sqlite_synchronous}")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    return engine


def upgrade_database(url: str, revision: str = "head") -> None:
    """Apply the Alembic migrations up to `revision` (`areal-service db upgrade`)."""
    engine = create_store_engine(url)
    try:
        upgrade_engine(engine, revision)
    finally:
        engine.dispose()
