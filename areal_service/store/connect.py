"""Engine creation for the trajectory store: SQLite pragmas (WAL, synchronous, busy
timeout, foreign keys) and pooling, or a PostgreSQL engine with its session settings
(lz4 TOAST compression); and `upgrade_database` (`areal-service db upgrade`). Touches
no rows.
"""

from __future__ import annotations

import os
import sqlite3
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Literal

from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import URL, make_url

from areal_service.store.migrate import upgrade_engine

if TYPE_CHECKING:
    from sqlalchemy.engine.interfaces import DBAPIModule

SQLITE_BUSY_TIMEOUT_MS = 30_000
"""How long a SQLite writer waits for another process's write lock before failing."""

_LZ4_TOAST = (
    "SELECT set_config('default_toast_compression', 'lz4', false) FROM pg_settings"
    " WHERE name = 'default_toast_compression' AND 'lz4' = ANY(enumvals)"
)
"""PostgreSQL 14+ built with lz4 (the packaged servers are): values this connection
TOASTs are compressed with lz4 instead of pglz. A completion's four 4 KiB token blobs
(1k+1k tokens) are over the TOAST threshold, and pglz spent ~35 µs of server CPU per
row trying to compress random-looking ids (measured, PostgreSQL 15: ~113 -> ~78 µs per
row of binary COPY); lz4 gives up on them fast and still shrinks the per-token versions
and long chat JSON. A per-connection setting, so no migration: values already stored
keep their method, and both decompress on any such server. No-op elsewhere (no row)."""


def _postgres_engine(url: URL) -> Engine:
    engine = create_engine(url, pool_pre_ping=True)

    @event.listens_for(engine, "connect")
    def _postgres_session(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        cursor.execute(_LZ4_TOAST)
        cursor.close()
        dbapi_connection.commit()  # a session setting made in a rolled-back transaction is undone

    return engine


def create_store_engine(
    url: str,
    *,
    sqlite_synchronous: Literal["OFF", "NORMAL", "FULL"] = "NORMAL",
    sqlite_max_size_mb: int | None = None,
) -> Engine:
    """An engine for `url`. SQLite connections get WAL, `synchronous`, a busy timeout,
    foreign keys and, with `sqlite_max_size_mb`, a page quota on every connect; an
    in-memory SQLite is refused because every pooled connection (the writer thread has
    its own) would see a different empty database."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "postgresql":
        return _postgres_engine(parsed)
    if parsed.get_backend_name() != "sqlite":
        return create_engine(parsed, pool_pre_ping=True)
    if parsed.database in (None, "", ":memory:") or parsed.query.get("mode") == "memory":
        raise ValueError(f"store url {url!r}: use a SQLite file, not an in-memory database")
    if sqlite_synchronous not in ("OFF", "NORMAL", "FULL"):
        raise ValueError(f"store.sqlite_synchronous={sqlite_synchronous!r}")
    _create_private(parsed.database)
    # Connections are made on demand; 10 kept covers the gateway's default thread pool
    # (cpu + 4 workers) and the sweeper, so none is closed on return and reopened (with
    # the pragmas below) under load, as overflow connections past SQLAlchemy's 5 were.
    engine = create_engine(parsed, pool_size=10, max_overflow=20)

    @event.listens_for(engine, "connect")
    def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        # WAL: readers never block the writer; with synchronous=NORMAL a commit survives
        # a process crash (FULL also survives power loss, one fsync per commit).
        _use_wal(cursor)
        cursor.execute(f"PRAGMA synchronous={sqlite_synchronous}")
        cursor.execute("PRAGMA foreign_keys=ON")
        if sqlite_max_size_mb is not None:
            # Per connection; SQLite keeps it at least the current page count. Past it a
            # write that needs a new page fails with SQLITE_FULL, as on a full disk.
            page_size = cursor.execute("PRAGMA page_size").fetchone()[0]
            pages = sqlite_max_size_mb * (1 << 20) // page_size
            cursor.execute(f"PRAGMA max_page_count={pages}")
        cursor.close()

    _read_only_is_disconnect(engine)
    return engine


def _create_private(database: str) -> None:
    """Create a missing SQLite file readable by its owner only (0600; it holds every
    prompt, reply and key hash). SQLite gives its `-wal` and `-shm` files the database
    file's permissions. An existing file keeps the mode its operator gave it. A `file:`
    URI is left to SQLite."""
    if database.startswith("file:"):
        return
    try:
        os.close(os.open(database, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except OSError:  # exists, or cannot be made (no such folder): SQLite says so later
        pass


def _use_wal(cursor: Any) -> None:
    """Switch the file to WAL (kept in the file: later connections find it so). The
    switch needs the file to itself, and SQLite refuses it at once, busy timeout or
    not, while another connection holds a lock (several processes opening a new store
    together), so it is retried for up to the busy timeout."""
    deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT_MS / 1000
    delay = 0.005
    while True:
        try:
            if str(cursor.execute("PRAGMA journal_mode").fetchone()[0]).lower() == "wal":
                return
            cursor.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


_SQLITE_READONLY = 8
"""Primary result code of every SQLITE_READONLY_* error."""


def _read_only_is_disconnect(engine: Engine) -> None:
    """Make SQLITE_READONLY discard the connection it came from. SQLite opens a file it
    cannot write (read-only mount, immutable file) read-only without a word, and that
    connection stays read-only after the file is writable again: kept in the pool (or
    by the completion writer), it would fail every write after the fault is gone.
    Counted as a disconnect, it is closed and the next use opens a fresh one."""
    dialect = engine.dialect
    base = dialect.is_disconnect

    def is_disconnect(error: DBAPIModule.Error, connection: Any, cursor: Any) -> bool:
        code = getattr(error, "sqlite_errorcode", None)  # Python 3.11+
        read_only = (code is not None and code & 0xFF == _SQLITE_READONLY) or (
            "readonly database" in str(error)
        )
        return read_only or base(error, connection, cursor)

    # A plain function over the bound method, on this dialect instance only (on purpose).
    dialect.is_disconnect = is_disconnect  # type: ignore[method-assign,assignment]


def upgrade_database(url: str, revision: str = "head") -> None:
    """Apply the Alembic migrations up to `revision` (`areal-service db upgrade`)."""
    engine = create_store_engine(url)
    try:
        upgrade_engine(engine, revision)
    finally:
        engine.dispose()


@contextmanager
def scratch_postgres_database(server_url: str, prefix: str) -> Iterator[str]:
    """A new, empty database `<prefix>_<random>` on the PostgreSQL server `server_url`
    (connected to as a maintenance database); yields its URL and drops it afterwards,
    forcing out connections left open. For tests and benchmarks. Raises
    sqlalchemy's OperationalError when the server is unreachable."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    admin = create_engine(
        server_url, isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 3}
    )
    try:
        with admin.connect() as connection:
            connection.execute(text(f'CREATE DATABASE "{name}"'))
        try:
            yield make_url(server_url).set(database=name).render_as_string(hide_password=False)
        finally:
            with admin.connect() as connection:
                connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        admin.dispose()
