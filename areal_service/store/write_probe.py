"""Whether the store takes writes right now: the readiness probe.

A SELECT answers while the database is locked, read-only or full, so readiness needs a
write that reaches the disk. On SQLite the probe rewrites the header's `user_version`
with its own value: that always appends one WAL frame (SQLite may skip a row UPDATE that
leaves the row as it was), so a locked database or a read-only file fails it, and
nothing changes.

A full disk is not caught by one small write: SQLite in WAL mode rewrites a reset WAL in
place, so a page-sized commit can succeed while every insert that grows the database
fails with SQLITE_FULL. So after a failed write the probe also asks how much room is
left: free space on the database's filesystem, and pages left under SQLite's
`max_page_count` (`store.sqlite_max_size_mb`), each against `HEADROOM_BYTES`. Only then:
a store that is nearly full but still taking writes is not reported as failing.
"""

from __future__ import annotations

import os
from pathlib import Path

from sqlalchemy import Engine, text
from sqlalchemy.exc import OperationalError

HEADROOM_BYTES = 1 << 20
"""Below this much room (filesystem free space, or pages left under `max_page_count`),
the store counts as full: a capture batch or the next WAL checkpoint would not fit."""


class StoreFull(OSError):
    """The store has less than `HEADROOM_BYTES` of room left (message says where)."""


WRITE_REFUSED: tuple[type[Exception], ...] = (OperationalError, StoreFull)
"""What a store call raises when the database cannot take a write now (full, locked,
read-only, unreachable): the caller may retry later (the gateway answers 503)."""


def probe_write(engine: Engine, *, check_room: bool = True) -> None:
    """One committed write, then (`check_room`, SQLite) the room check; raises what keeps
    writes from working: SQLAlchemy's `OperationalError` (locked past the busy timeout,
    read-only, I/O error) or `StoreFull`. Blocking (run it in a thread); waits at most
    the busy timeout."""
    if engine.dialect.name != "sqlite":
        # PostgreSQL writes a new row version for any UPDATE, so this reaches its WAL.
        with engine.begin() as connection:
            connection.execute(text("UPDATE alembic_version SET version_num = version_num"))
        return
    with engine.connect() as connection:
        version = connection.exec_driver_sql("PRAGMA user_version").scalar_one()
        # Outside a transaction (pysqlite begins one only for DML): its own commit.
        connection.exec_driver_sql(f"PRAGMA user_version = {int(version)}")
        if not check_room:
            return
        page_size, page_count, free_pages, max_pages = (
            int(connection.exec_driver_sql(f"PRAGMA {name}").scalar_one())
            for name in ("page_size", "page_count", "freelist_count", "max_page_count")
        )
    quota_left = (max_pages - page_count + free_pages) * page_size
    if quota_left < HEADROOM_BYTES:
        raise StoreFull(
            f"store quota reached: {quota_left} bytes left of "
            f"{max_pages * page_size} (max_page_count)"
        )
    database = engine.url.database
    if database:
        free = disk_free_bytes(Path(database).resolve().parent)
        if free < HEADROOM_BYTES:
            raise StoreFull(f"disk full: {free} bytes free for the database")


def disk_free_bytes(directory: Path) -> int:
    """Bytes this process may still write on `directory`'s filesystem: root may use the
    blocks reserved for it (ext4 keeps 5%), others only the available ones."""
    stats = os.statvfs(directory)
    blocks = stats.f_bfree if os.geteuid() == 0 else stats.f_bavail
    return blocks * stats.f_frsize
