"""`serve_gateway`: a gateway served as `areal-service serve` serves it (a plain module
the suite's conftest and tests import)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import uvicorn

from areal_service.config import load_config
from gateway.app import create_app
from gateway.connections import HttpImpl
from gateway.server import uvicorn_options
from support.harness import ADMIN_KEY, Gateway
from support.loopback import free_port


@contextmanager
def serve_gateway(tmp_dir: Path, model_dir: Path, backends: list[str], *overrides: str,
                  http: HttpImpl = "httptools") -> Iterator[Gateway]:
    """A gateway on a free loopback port with the served process's uvicorn options
    (`http`: which of uvicorn's HTTP/1.1 implementations), its own SQLite store."""
    port = free_port()
    cfg = load_config(overrides=[
        f"data_dir={tmp_dir}", f"engine.model={model_dir}", f"gateway.port={port}",
        f"gateway.backends={backends}", f"gateway.admin_key={ADMIN_KEY}",
        "gateway.backend_unavailable_deadline_s=2", "log_level=warning", *overrides])
    app = create_app(cfg)
    options = uvicorn_options(cfg, http) | {"loop": "asyncio", "lifespan": "on"}
    server = uvicorn.Server(uvicorn.Config(app, **options))  # type: ignore[arg-type]
    thread = threading.Thread(target=server.run, daemon=True, name="sec-gateway")
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("gateway did not start")
        time.sleep(0.02)
    try:
        yield Gateway(f"http://127.0.0.1:{port}", app, cfg)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
