"""Alembic: upgrading an empty database to head matches schema.py exactly (autogenerate
finds no diff), upgrades are repeatable, and downgrade/upgrade cycles cleanly."""

from __future__ import annotations

import sqlite3
import threading
import time

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, inspect, text

from areal_service.config import StoreConfig
from areal_service.store import TrajectoryStore, alembic_config, upgrade_database
from areal_service.store.connect import create_store_engine
from areal_service.store.migrate import migrations_dir
from areal_service.store.schema import Base

TABLES = {
    "api_keys",
    "sessions",
    "completions",
    "rewards",
    "weight_versions",
    "train_steps",
    "leases",
    "key_counters",
    "admissions",
    "console_revocations",
    "auth_failures",
    "policies",
    "policy_model_names",
}


HEAD = "0016_policy_roles"
"""The newest revision: what an upgraded database stands at."""


def _state(url: str) -> tuple[list, str | None, set[str]]:
    """(autogenerate diff against schema.py, current revision, table names)."""
    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            context = MigrationContext.configure(connection, opts={"compare_type": True})
            diff = compare_metadata(context, Base.metadata)
            return diff, context.get_current_revision(), set(inspect(connection).get_table_names())
    finally:
        engine.dispose()


def test_one_head_in_the_installed_package():
    script = ScriptDirectory.from_config(alembic_config("sqlite:///unused.db"))
    assert script.get_heads() == [HEAD]
    assert (migrations_dir() / "env.py").is_file()
    assert (migrations_dir() / "versions" / "0001_initial.py").is_file()


def test_alembic_config_keeps_percent_encoded_urls():
    url = "postgresql+psycopg://user:p%40ss%25@db:5432/areal"
    assert alembic_config(url).get_main_option("sqlalchemy.url") == url


def test_upgrade_empty_database_matches_schema(store_url):
    upgrade_database(store_url)
    diff, revision, tables = _state(store_url)
    assert diff == []
    assert revision == HEAD
    assert tables == TABLES | {"alembic_version"}
    upgrade_database(store_url)  # at head already: a no-op
    assert _state(store_url) == (diff, revision, tables)


def test_downgrade_to_base_and_back(store_url):
    upgrade_database(store_url)
    # Through env.py's own engine (no connection passed), as the `alembic` CLI would.
    command.downgrade(alembic_config(store_url), "base")
    diff, revision, tables = _state(store_url)
    assert revision is None and tables == {"alembic_version"}
    assert {op[1].name for op in diff if op[0] == "add_table"} == TABLES
    upgrade_database(store_url)
    assert _state(store_url)[:2] == ([], HEAD)


def test_open_migrates_only_when_asked(store_url):
    TrajectoryStore.open(store_url, StoreConfig(auto_migrate=False)).close()
    assert _state(store_url)[2] == set()
    TrajectoryStore.open(store_url, StoreConfig(auto_migrate=True)).close()
    assert _state(store_url)[1:] == (HEAD, TABLES | {"alembic_version"})


def test_concurrent_upgrades_of_a_fresh_database_all_succeed(store_url: str) -> None:
    """Gateway workers and replicas start together on one fresh database: each upgrades
    it at start, and the ones that lose the race must wait, then find it at head."""
    import threading

    from areal_service.store import create_store_engine
    from areal_service.store.migrate import upgrade_engine

    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def upgrade() -> None:
        engine = create_store_engine(store_url)
        try:
            barrier.wait()
            upgrade_engine(engine)
        except BaseException as e:  # noqa: BLE001 - collected for the assert
            errors.append(e)
        finally:
            engine.dispose()

    threads = [threading.Thread(target=upgrade) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert _state(store_url)[:2] == ([], HEAD)


def test_wal_switch_waits_for_another_opener(tmp_path):
    """A new SQLite store opened while another connection holds a write lock (several
    processes starting on a fresh file): switching to WAL, which SQLite refuses at once
    then, waits for the lock instead of failing."""
    path = tmp_path / "store.db"
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    holder.execute("CREATE TABLE t (x)")
    holder.execute("BEGIN IMMEDIATE")
    holder.execute("INSERT INTO t VALUES (1)")
    release = threading.Timer(0.3, lambda: holder.execute("COMMIT"))
    release.start()
    engine = create_store_engine(f"sqlite:///{path}")
    started = time.monotonic()
    try:
        with engine.connect() as connection:
            assert connection.execute(text("PRAGMA journal_mode")).scalar() == "wal"
        assert time.monotonic() - started >= 0.2  # it did wait for the holder
    finally:
        release.join()
        engine.dispose()
        holder.close()
