"""`serve_gateway`: a gateway served as `areal-service serve` serves it (a plain module
the suite's conftest and tests import)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from areal_service.config import load_config
from gateway.connections import HttpImpl
from gateway.server import uvicorn_options
from support.harness import ADMIN_KEY, Gateway, serve_app
from support.loopback import free_port
from support.postgres_db import fresh_postgres_database


@contextmanager
def serve_gateway(
    tmp_dir: Path,
    model_dir: Path,
    backends: list[str],
    *overrides: str,
    http: HttpImpl = "httptools",
) -> Iterator[Gateway]:
    """A gateway on a free loopback port with the served process's uvicorn options
    (`http`: which of uvicorn's HTTP/1.1 implementations), its own SQLite store."""
    port = free_port()
    cfg = load_config(
        overrides=[
            f"data_dir={tmp_dir}",
            f"engine.model={model_dir}",
            f"gateway.port={port}",
            f"gateway.router.backends={backends}",
            f"gateway.auth.admin_key={ADMIN_KEY}",
            "gateway.router.backend_unavailable_deadline_s=2",
            "log_level=warning",
            *overrides,
        ]
    )
    options = uvicorn_options(cfg, http) | {"loop": "asyncio"}
    with serve_app(cfg, options, thread_name="sec-gateway") as gw:
        yield gw


STORES = ["sqlite", "postgres"]
"""The store legs of a test parametrized over both backends (`store_overrides`)."""


def store_overrides(leg: str, stack: contextlib.ExitStack) -> list[str]:
    """The config overrides of a store leg: none for SQLite (the gateway's own file);
    for PostgreSQL a fresh database, dropped when `stack` closes (the test skips without
    a server)."""
    if leg != "postgres":
        return []
    databases = fresh_postgres_database()
    stack.callback(databases.close)
    return [f"store.url={next(databases)}"]
