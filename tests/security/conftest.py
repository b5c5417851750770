"""The security suite: the cases an outside audit attacked, against a real gateway served
exactly as `areal-service serve` serves it (`gateway.server.uvicorn_options`: the
connection bounds, the proxy-header policy), over loopback, on SQLite, in front of the
local engine with the tiny model."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import pytest
import uvicorn

from engine.testing import start_engine_in_thread

sys.path.insert(0, str(Path(__file__).parents[1] / "integration"))  # harness
from harness import ADMIN_KEY, Gateway  # noqa: E402
from loopback import free_port  # noqa: E402

from areal_service.config import load_config  # noqa: E402
from gateway.app import create_app  # noqa: E402
from gateway.connections import HttpImpl  # noqa: E402
from gateway.server import uvicorn_options  # noqa: E402


@pytest.fixture(scope="session")
def sec_engine_url(tiny_model_dir: Path) -> Iterator[str]:
    """The local engine serving the tiny model for the suite."""
    with start_engine_in_thread(tiny_model_dir) as url:
        yield url


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


@pytest.fixture()
def serve(tmp_path: Path, tiny_model_dir: Path, sec_engine_url: str
          ) -> Callable[..., AbstractContextManager[Gateway]]:
    """`serve(*overrides, http=...)`: a fresh gateway in front of the suite's engine."""
    def start(*overrides: str, http: HttpImpl = "httptools") -> AbstractContextManager[Gateway]:
        sub = tmp_path / f"gw{len(list(tmp_path.iterdir()))}"
        return serve_gateway(sub, tiny_model_dir, [sec_engine_url], *overrides, http=http)
    return start
