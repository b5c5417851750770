"""Alembic plumbing: the in-code Alembic config and upgrades through an engine.

The scripts live in the installed `migrations` package (found through importlib, so an
installed wheel works without an alembic.ini). `store.upgrade_database(url)` (the CLI's
`areal-service db upgrade`) and `TrajectoryStore.open` call in here. Touches no rows.
"""

from __future__ import annotations

import fcntl
import importlib.util
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, text

logger = logging.getLogger(__name__)


def migrations_dir() -> Path:
    """Directory of the installed `migrations` package (env.py, versions/)."""
    spec = importlib.util.find_spec("migrations")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the `migrations` package is not installed with areal_service")
    found = Path(next(iter(spec.submodule_search_locations)))
    if not (found / "env.py").is_file():  # another project's `migrations` shadows ours
        raise RuntimeError(f"{found} is not the areal_service migrations package (no env.py)")
    return found


def alembic_config(url: str) -> Config:
    """An Alembic config for `url`, built in code (no alembic.ini is read)."""
    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    config.set_main_option("path_separator", "os")
    # set_main_option goes through configparser interpolation: `%` must be doubled
    # (percent-encoded passwords in the URL).
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def upgrade_connection(connection: Connection, url: str, revision: str = "head") -> None:
    """Upgrade through an open connection; env.py uses it instead of its own engine, so
    the caller's engine settings (SQLite pragmas) apply to the migration."""
    config = alembic_config(url)
    config.attributes["connection"] = connection
    command.upgrade(config, revision)


def is_at_head(connection: Connection) -> bool:
    """Whether the database is already at the scripts' head revision(s). Cheap: reads the
    version table and the scripts directory, without running env.py (which pulls in
    Alembic's autogenerate plugins and costs about two seconds per start)."""
    script = ScriptDirectory(str(migrations_dir()))
    current = set(MigrationContext.configure(connection).get_current_heads())
    return current == set(script.get_heads())


MIGRATION_LOCK_KEY = 0x41_52_45_41_4C  # "AREAL": the PostgreSQL advisory lock's key


@contextmanager
def _upgrading_alone(engine: Engine) -> Iterator[None]:
    """Serialise upgrades of one database across processes: gateway workers and replicas
    start together on a fresh database, and a second upgrade racing the first would
    create tables the first just made. PostgreSQL: a session advisory lock; SQLite: an
    exclusive `flock` on a file beside the database (SQLite is one host's anyway)."""
    if engine.dialect.name == "postgresql":
        # Autocommit: the lock is the session's, and no transaction stays open (idle in
        # transaction) on this connection while the upgrade runs on another.
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
            connection.execute(text("SELECT pg_advisory_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
            try:
                yield
            finally:
                connection.execute(
                    text("SELECT pg_advisory_unlock(:key)"), {"key": MIGRATION_LOCK_KEY}
                )
        return
    database = engine.url.database if engine.dialect.name == "sqlite" else None
    if not database:
        yield
        return
    with open(f"{database}.migrate-lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


def upgrade_engine(engine: Engine, revision: str = "head") -> None:
    """Upgrade the database behind `engine` to `revision` in one connection (one process
    at a time: `_upgrading_alone`)."""
    url = engine.url.render_as_string(hide_password=False)
    with engine.connect() as connection:  # the common case: already there, no lock
        if revision == "head" and is_at_head(connection):
            return
    with _upgrading_alone(engine), engine.begin() as connection:
        if revision == "head" and is_at_head(connection):
            return  # another process upgraded it while this one waited
        upgrade_connection(connection, url, revision)
    logger.info("database %s at revision %s", engine.url, revision)
