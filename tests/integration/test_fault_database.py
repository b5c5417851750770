"""Fault suite, database side, against a real gateway on loopback (SQLite store, the
tiny local engine): the store turned read-only, filled to its size quota, and on a
really full disk. For each: requests that must be recorded fail with 503
`capture_failed` in the OpenAI shape with retry-after (never a 500, and no completion is
acknowledged without being stored); `/health/readiness` is 503 with `db` naming the
failure; once the fault is removed, readiness is ready again at the next call and new
completions are stored. (The locked database: tests/integration/test_readiness.py.)

Read-only stands as an immutable database file (`chattr +i`; root may write any file
mode): writes through open files fail with EPERM, and SQLite opens new connections
read-only, as on a read-only remount. The full disk is a small tmpfs mounted for the
test and filled. Both need root with the matching capability and skip otherwise; the
quota test needs nothing."""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from support.faults import chattr
from support.harness import ADMIN_KEY

from gateway.routes import health

ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
CHAT = {"model": "areal-policy", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
RECOVERY_BOUND_S = health.PROBE_TIMEOUT_S + 1.0
"""Readiness is ready again at the first call after the fault is gone (each call probes
while the last capture failed); slack for a loaded machine."""


def _ready(http: httpx.Client) -> httpx.Response:
    return http.get("/health/readiness")


def _until(fn: Callable[[], bool], timeout_s: float) -> float:
    """Seconds until `fn()` held (AssertionError past `timeout_s`)."""
    start = time.monotonic()
    while not fn():
        assert time.monotonic() - start < timeout_s, "condition not met in time"
        time.sleep(0.05)
    return time.monotonic() - start


def _fault_cycle(
    gw,
    inject: Callable[[], None],
    remove: Callable[[], None],
    db_error: str,
    *,
    seen_without_traffic: bool,
) -> None:
    """Chat, inject the fault, check the 503s and readiness, remove it, check recovery;
    every completion acknowledged with a 200 is in the store at the end."""
    http = httpx.Client(base_url=gw.url, timeout=60, headers=ADMIN)
    acked: list[str] = []
    first = http.post("/v1/chat/completions", json=CHAT)
    assert first.status_code == 200, first.text
    acked.append(first.json()["id"])
    assert _ready(http).status_code == 200
    inject()
    try:
        if seen_without_traffic:  # no request has failed yet: the periodic probe sees it
            took = _until(
                lambda: _ready(http).status_code == 503,
                health.PROBE_INTERVAL_S + health.PROBE_TIMEOUT_S + 2,
            )
            assert took < health.PROBE_INTERVAL_S + health.PROBE_TIMEOUT_S + 1, took
        for _ in range(300):  # a full store may take a few more before it refuses
            reply = http.post("/v1/chat/completions", json=CHAT)
            if reply.status_code != 200:
                break
            acked.append(reply.json()["id"])
        assert reply.status_code == 503, reply.text
        error = reply.json()["error"]
        assert set(error) >= {"message", "type", "param", "code"}, error
        assert error["code"] == "capture_failed" and error["type"] == "server_error", error
        assert int(reply.headers["retry-after"]) >= 1
        ready = _ready(http)
        assert ready.status_code == 503 and ready.json()["status"] == "unavailable"
        assert re.search(db_error, ready.json()["db"]), ready.json()
        assert ready.json()["backends"][0]["healthy"]  # the backend is fine
    finally:
        remove()
    took = _until(lambda: _ready(http).status_code == 200, RECOVERY_BOUND_S + 5)
    assert took < RECOVERY_BOUND_S, took
    assert _ready(http).json()["db"] == "ok"
    after = http.post("/v1/chat/completions", json=CHAT)
    assert after.status_code == 200, after.text
    acked.append(after.json()["id"])
    store = gw.state.store
    missing = [cid for cid in acked if store.get_completion(cid) is None]
    assert not missing, f"acknowledged but not stored: {missing}"


def test_read_only_database_503_not_ready_then_recovers(
    tmp_path, tiny_model_dir, engine_url, gateway_factory, monkeypatch
):
    probe = tmp_path / "chattr-probe"
    probe.touch()
    if not (chattr("+i", probe) and chattr("-i", probe)):
        pytest.skip("chattr +i is not permitted here (needs root and ext4/xfs/btrfs)")
    monkeypatch.setattr(health, "PROBE_INTERVAL_S", 0.5)  # 5 s in service
    db = tmp_path / "areal.db"
    # Not -shm: SQLite maps it, and a store to an immutable mapping is SIGBUS.
    files = (db, Path(f"{db}-wal"))
    with gateway_factory(tmp_path, tiny_model_dir, [engine_url]) as gw:
        _fault_cycle(
            gw,
            lambda: chattr("+i", *files),
            lambda: chattr("-i", *files),
            r"^error: writes failing \(.*(disk I/O error|readonly database)",
            seen_without_traffic=True,
        )


def test_store_at_its_size_quota_503_not_ready_then_recovers(
    tmp_path, tiny_model_dir, engine_url, gateway_factory
):
    quota_mb = 2
    db = tmp_path / "areal.db"

    def fill() -> None:  # another writer takes the space up to the last few pages
        raw = sqlite3.connect(db, isolation_level=None)
        raw.execute("CREATE TABLE filler (blob BLOB)")
        page = raw.execute("PRAGMA page_size").fetchone()[0]
        # The filler obeys the same quota: one 16 KB row spans several pages, so without
        # it the last insert could carry the file past the quota (where it ended depends on
        # the schema's size, which each migration moves), and "the quota held" below would
        # measure the filler, not the gateway.
        raw.execute(f"PRAGMA max_page_count={quota_mb * 2**20 // page}")
        while raw.execute("PRAGMA page_count").fetchone()[0] * page < quota_mb * 2**20 - 8192:
            try:
                raw.execute("INSERT INTO filler VALUES (randomblob(16000))")
            except sqlite3.OperationalError:  # full: the quota's last pages are taken
                break
        raw.close()

    def free() -> None:  # its pages go to the freelist; the gateway reuses them
        raw = sqlite3.connect(db, isolation_level=None)
        raw.execute("DROP TABLE filler")
        raw.close()

    with gateway_factory(
        tmp_path, tiny_model_dir, [engine_url], f"store.sqlite_max_size_mb={quota_mb}"
    ) as gw:
        _fault_cycle(
            gw,
            fill,
            free,
            r"^error: writes failing \(StoreFull: store quota reached",
            seen_without_traffic=False,
        )
        with gw.state.store.engine.connect() as connection:
            pages = connection.exec_driver_sql("PRAGMA page_count").scalar_one()
            page = connection.exec_driver_sql("PRAGMA page_size").scalar_one()
        assert pages * page <= quota_mb * 2**20  # the quota held


def _fill_disk(path: Path) -> None:
    """Write `path` until the filesystem has no block left."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for chunk in (1 << 20, 1 << 16, 1 << 12, 1):
            try:
                while True:
                    os.write(fd, b"\0" * chunk)
            except OSError as error:
                assert error.errno == 28, error  # ENOSPC
    finally:
        os.close(fd)


def test_full_disk_503_not_ready_then_recovers(
    tmp_path, tiny_model_dir, engine_url, gateway_factory
):
    data = tmp_path / "disk"
    data.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(data)],
        capture_output=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    filler = data / "filler"
    try:
        with gateway_factory(data, tiny_model_dir, [engine_url]) as gw:
            _fault_cycle(
                gw,
                lambda: _fill_disk(filler),
                filler.unlink,
                # the probe's own write, or the room check after it
                r"^error: writes failing \(.*(database or disk is full"
                r"|StoreFull: disk full: \d+ bytes free)",
                seen_without_traffic=False,
            )
    finally:
        if subprocess.run(["umount", str(data)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(data)], capture_output=True)
