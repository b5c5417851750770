"""The store at its edges: a full store answers 503 with retry-after on every write route
(never a 500), and the SQLite database file is readable by its owner only."""

from __future__ import annotations

import sqlite3
import stat
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import httpx

ADMIN = {"authorization": "Bearer sk-test-admin"}


def _fill(db: Path, quota_mb: int) -> None:
    """Another writer takes the space up to the last few pages of the quota."""
    raw = sqlite3.connect(db, isolation_level=None)
    raw.execute("CREATE TABLE filler (blob BLOB)")
    page = raw.execute("PRAGMA page_size").fetchone()[0]
    while raw.execute("PRAGMA page_count").fetchone()[0] * page < quota_mb * 2**20 - 4096:
        raw.execute("INSERT INTO filler VALUES (randomblob(4000))")
    raw.close()


def test_a_full_store_is_503_on_every_write_route(
    serve: Callable[..., AbstractContextManager[Any]],
) -> None:
    with serve("store.sqlite_max_size_mb=2") as gw:
        http = httpx.Client(base_url=gw.url, headers=ADMIN, timeout=30)
        group = http.post("/rl/sessions", json={"group_size": 1}).json()
        _fill(gw.config.data_dir / "areal.db", 2)
        writes = [
            ("/rl/sessions", {"group_size": 4, "metadata": {"x": "y" * 3000}}),
            ("/admin/keys", {"name": "k" * 200, "metadata": {"x": "y" * 3000}}),
            # additive: each try adds (a repeated reward of one name is refused)
            ("/v1/rewards", {"session_id": group["session_id"], "value": 1.0, "additive": True}),
            (f"/rl/sessions/{group['session_id']}/end", {}),
        ]
        codes = {}
        for path, body in writes:
            for _ in range(50):  # the last free pages may take a few writes
                reply = http.post(path, json=body)
                if reply.status_code >= 300 or path.endswith("/end"):
                    break
            codes[path.split("/")[-1]] = reply.status_code
            if reply.status_code == 503:
                assert int(reply.headers["retry-after"]) >= 1
                assert reply.json()["error"]["type"] == "server_error"
        assert codes.pop("end") in (200, 503)  # an update in place may still fit
        assert codes == {"sessions": 503, "keys": 503, "rewards": 503}, codes
        assert http.get("/health/liveness").status_code == 200


def test_the_database_file_is_private(serve: Callable[..., AbstractContextManager[Any]]) -> None:
    with serve() as gw:
        data = gw.config.data_dir
        for name in ("areal.db", "areal.db-wal", "areal.db-shm"):
            path = data / name
            if path.exists():
                mode = stat.S_IMODE(path.stat().st_mode)
                assert mode & 0o077 == 0, f"{name} is {oct(mode)}"
