"""A real gateway on loopback for the tests (`from support.harness import ...`; a plain
module, not a conftest, so its import never depends on collection order)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from sqlalchemy import select
from sqlalchemy.orm import Session

from areal_service.config import ServiceConfig, load_config
from areal_service.store import TrajectoryStore
from areal_service.store.rows import completion_from_row
from areal_service.store.schema import CompletionRow
from areal_service.types import CompletionRecord
from gateway.app import create_app
from gateway.state import GatewayState
from support.loopback import free_port

ADMIN_KEY = "sk-test-admin"


@dataclass
class Gateway:
    url: str
    app: object
    config: ServiceConfig

    @property
    def state(self) -> GatewayState:
        return self.app.state.gateway  # type: ignore[attr-defined]

    @property
    def v1(self) -> str:
        return f"{self.url}/v1"


@contextmanager
def run_gateway(
    tmp_dir: Path, model_dir: Path, backends: list[str], *overrides: str
) -> Iterator[Gateway]:
    """A gateway on a free loopback port with its own SQLite store under `tmp_dir`."""
    port = free_port()
    cfg = load_config(
        overrides=[
            f"data_dir={tmp_dir}",
            f"engine.model={model_dir}",
            f"gateway.port={port}",
            f"gateway.router.backends={backends}",
            f"gateway.auth.admin_key={ADMIN_KEY}",
            "gateway.router.backend_unavailable_deadline_s=2",
            *overrides,
        ]
    )
    with serve_app(cfg, {"host": "127.0.0.1", "port": port, "log_level": "warning"}) as gw:
        yield gw


@contextmanager
def serve_app(
    cfg: ServiceConfig, options: dict[str, object], thread_name: str = "gateway-uvicorn"
) -> Iterator[Gateway]:
    """`create_app(cfg)` under uvicorn with `options` in a thread, until the block ends."""
    app = create_app(cfg)
    server = uvicorn.Server(uvicorn.Config(app, **{"lifespan": "on", **options}))  # type: ignore[arg-type]
    thread = threading.Thread(target=server.run, daemon=True, name=thread_name)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("gateway did not start")
        time.sleep(0.02)
    try:
        yield Gateway(f"http://127.0.0.1:{cfg.gateway.port}", app, cfg)
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def stored_completions(store: TrajectoryStore) -> list[CompletionRecord]:
    """Every completion in `store`, oldest first (tests read what the gateway recorded)."""
    with Session(store.engine) as session:
        rows = session.scalars(
            select(CompletionRow).order_by(CompletionRow.created_at, CompletionRow.id)
        )
        return [completion_from_row(row) for row in rows]
