"""`store:`: where the trajectory store lives and how it commits."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from areal_service.config.section import Section


class StoreConfig(Section):
    url: str | None = None
    """SQLAlchemy URL of the trajectory store. None means SQLite at `<data_dir>/areal.db`.
    The `DATABASE_URL` environment variable sets this too."""
    commit_interval_ms: float = 2.0
    """Group commit: how long the writer waits to gather more records before one
    transaction. Each caller is told when its record is durable."""
    max_batch_records: int = Field(512, ge=1)
    """Group commit: the most records written in one transaction."""
    sqlite_synchronous: Literal["OFF", "NORMAL", "FULL"] = "NORMAL"
    """SQLite `synchronous` pragma. NORMAL with WAL survives a process crash; FULL also
    survives power loss at the cost of an fsync per commit."""
    auto_migrate: bool = True
    """Apply Alembic migrations on start (the embedded default). Turn off when a DBA
    runs `areal-service db upgrade` against a shared database."""
    sqlite_max_size_mb: int | None = Field(None, ge=1)
    """SQLite only: the most MiB the database file may grow to (`PRAGMA max_page_count`
    on every connection; never below its current size). Past it, writes fail as on a
    full disk: requests get 503 `capture_failed` and readiness says `db: error ... store
    quota reached` until space is freed (deleted rows' pages are reused) or the quota is
    raised (a restart). Its WAL file adds up to a few MiB more. None: no quota."""
