"""The security suite: the cases an outside audit attacked, against a real gateway served
exactly as `areal-service serve` serves it (`gateway.server.uvicorn_options`: the
connection bounds, the proxy-header policy), over loopback, on SQLite, in front of the
local engine with the tiny model."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import pytest
from support.harness import Gateway
from support.security_harness import serve_gateway, store_overrides

from engine.testing import start_engine_in_thread
from gateway.connections import HttpImpl


@pytest.fixture(scope="session")
def sec_engine_url(tiny_model_dir: Path) -> Iterator[str]:
    """The local engine serving the tiny model for the suite."""
    with start_engine_in_thread(tiny_model_dir) as url:
        yield url


@pytest.fixture()
def serve(
    tmp_path: Path, tiny_model_dir: Path, sec_engine_url: str
) -> Callable[..., AbstractContextManager[Gateway]]:
    """`serve(*overrides, http=...)`: a fresh gateway in front of the suite's engine."""

    def start(*overrides: str, http: HttpImpl = "httptools") -> AbstractContextManager[Gateway]:
        sub = tmp_path / f"gw{len(list(tmp_path.iterdir()))}"
        return serve_gateway(sub, tiny_model_dir, [sec_engine_url], *overrides, http=http)

    return start


@pytest.fixture(scope="module")
def serve_on(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, sec_engine_url: str
) -> Callable[..., AbstractContextManager[Gateway]]:
    """`serve_on(leg, *overrides)`: a gateway on the `leg` store (`STORES`: SQLite, or a
    fresh PostgreSQL database, skipped without a server), for a module's tests."""

    @contextmanager
    def start(leg: str, *overrides: str) -> Iterator[Gateway]:
        with contextlib.ExitStack() as stack:
            store = store_overrides(leg, stack)
            tmp = tmp_path_factory.mktemp("gw")
            yield stack.enter_context(
                serve_gateway(tmp, tiny_model_dir, [sec_engine_url], *overrides, *store)
            )

    return start
