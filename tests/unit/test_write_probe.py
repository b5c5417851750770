"""The readiness write probe on real SQLite files: it reaches the disk, fails while the
database is locked, reports a store at its size quota (`store.sqlite_max_size_mb`) as
full and recovers when space is freed; the quota holds; and a connection SQLite opened
read-only during a fault does not keep failing writes after it."""

from __future__ import annotations

import os
import sqlite3
import subprocess
from pathlib import Path

import pytest
from sqlalchemy.exc import OperationalError
from support.faults import chattr

from areal_service.config import StoreConfig
from areal_service.store import TrajectoryStore, connect
from areal_service.store.write_probe import HEADROOM_BYTES, StoreFull
from areal_service.types import CompletionRecord

MIB = 1 << 20


def _record(cid: str, n: int = 2000) -> CompletionRecord:
    return CompletionRecord(
        id=cid,
        model="m",
        prompt_ids=tuple(range(n)),
        output_ids=(1, 2),
        output_logprobs=(-0.5, -0.5),
        output_versions=(0, 0),
        finish_reason="stop",
    )


def _wal_size(db: Path) -> int:
    return os.path.getsize(f"{db}-wal")


def _fill(db: Path, leave_bytes: int, limit_bytes: int) -> None:
    """Grow the database from a connection without the quota until less than
    `leave_bytes` is left under `limit_bytes` (another writer used the space)."""
    raw = sqlite3.connect(db, isolation_level=None)
    raw.execute("CREATE TABLE filler (blob BLOB)")
    page = raw.execute("PRAGMA page_size").fetchone()[0]
    while raw.execute("PRAGMA page_count").fetchone()[0] * page < limit_bytes - leave_bytes:
        raw.execute("INSERT INTO filler VALUES (randomblob(16000))")
    raw.close()


def test_probe_write_reaches_the_wal_and_changes_nothing(tmp_path: Path):
    db = tmp_path / "store.db"
    store = TrajectoryStore.open(f"sqlite:///{db}", StoreConfig())
    before = _wal_size(db)
    store.probe_write()
    assert _wal_size(db) > before  # a page frame appended and committed
    with store.engine.connect() as connection:
        assert connection.exec_driver_sql("PRAGMA user_version").scalar_one() == 0
    store.close()


def test_probe_fails_while_another_process_holds_the_write_lock(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(connect, "SQLITE_BUSY_TIMEOUT_MS", 100)
    db = tmp_path / "store.db"
    store = TrajectoryStore.open(f"sqlite:///{db}", StoreConfig())
    lock = sqlite3.connect(db, isolation_level=None)
    lock.execute("BEGIN IMMEDIATE")
    with pytest.raises(OperationalError, match="locked"):
        store.probe_write()
    lock.execute("ROLLBACK")
    lock.close()
    store.probe_write()
    store.close()


def test_quota_holds_and_a_full_store_is_reported_until_space_is_freed(tmp_path: Path):
    db = tmp_path / "store.db"
    store = TrajectoryStore.open(f"sqlite:///{db}", StoreConfig(sqlite_max_size_mb=2))
    store.probe_write()  # room left: the quota is not reached
    _fill(db, leave_bytes=HEADROOM_BYTES // 4, limit_bytes=2 * MIB)
    # The store's own writes fill the last pages, then fail as on a full disk.
    with pytest.raises(OperationalError, match="database or disk is full"):
        for i in range(1000):
            store.add_completion(_record(f"c{i}"))
    with store.engine.connect() as connection:
        pages = connection.exec_driver_sql("PRAGMA page_count").scalar_one()
        page = connection.exec_driver_sql("PRAGMA page_size").scalar_one()
    # The quota held (pages not yet checkpointed into the file count too).
    assert 2 * MIB - 64 * 1024 < pages * page <= 2 * MIB
    store.probe_write(check_room=False)  # a one-page write still fits...
    with pytest.raises(StoreFull, match="store quota reached"):
        store.probe_write()  # ...but the room check tells the truth
    raw = sqlite3.connect(db, isolation_level=None)
    raw.execute("DROP TABLE filler")  # its pages go to the freelist, reused in place
    raw.close()
    store.probe_write()
    store.add_completion(_record("after"))
    assert store.get_completion("after") is not None
    store.close()


@pytest.mark.processes
def test_connection_opened_read_only_during_a_fault_is_not_kept(tmp_path: Path):
    """An immutable file stands for a read-only mount: existing connections' writes fail,
    and SQLite opens new connections read-only without a word. After the fault those
    connections must not keep failing (they used to stay in the pool)."""
    db = tmp_path / "store.db"
    store = TrajectoryStore.open(f"sqlite:///{db}", StoreConfig())
    files = (db, Path(f"{db}-wal"))  # not -shm: SQLite maps it, and a write to it would fault
    if not chattr("+i", *files):
        pytest.skip("chattr +i is not permitted here (needs root and ext4/xfs/btrfs)")
    try:
        with pytest.raises(OperationalError):
            store.probe_write()  # a pooled connection: the write fails (EPERM)
        store.engine.dispose()
        store.close()  # the completion writer's connection too: both reopen read-only
        with pytest.raises(OperationalError, match="readonly"):
            store.probe_write()
        with pytest.raises(OperationalError, match="readonly|disk I/O"):
            store.add_completion(_record("during"))
    finally:
        assert chattr("-i", *files)
    store.probe_write()
    store.add_completion(_record("after"))
    assert store.get_completion("after") is not None
    assert store.get_completion("during") is None
    store.close()


@pytest.mark.processes
def test_full_disk_is_reported_even_when_a_page_write_still_fits(tmp_path: Path):
    """The reason for the room check: after a checkpoint SQLite rewrites its WAL in place,
    so on a full disk the probe's one-page commit succeeds while growth fails."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)],
        capture_output=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        db = mnt / "store.db"
        store = TrajectoryStore.open(f"sqlite:///{db}", StoreConfig())
        for i in range(20):
            store.add_completion(_record(f"c{i}"))
        with store.engine.connect() as connection:  # the WAL restarts at its beginning
            connection.exec_driver_sql("PRAGMA wal_checkpoint(RESTART)")
        filler = mnt / "filler"
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
        with pytest.raises(OSError, match="No space left"):
            while True:
                os.write(fd, b"\0" * 4096)
        os.close(fd)
        with pytest.raises(OperationalError, match="database or disk is full"):
            for i in range(100):
                store.add_completion(_record(f"full{i}", n=20000))
        # Whether the probe's page still fits in the WAL's old space after the failed
        # growth depends on where the last record ended in it (the schema's size moves
        # that), so give the disk back a few pages: a page write fits, growth does not.
        os.truncate(filler, max(os.path.getsize(filler) - 64 * 1024, 0))
        store.probe_write(check_room=False)  # one page fits
        with pytest.raises(StoreFull, match="disk full"):
            store.probe_write()
        filler.unlink()
        store.probe_write()
        store.add_completion(_record("after", n=20000))
        store.close()
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_probe_write_on_each_dialect(store: TrajectoryStore):
    store.probe_write()  # PostgreSQL: a committed UPDATE of Alembic's version row
