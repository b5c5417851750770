"""The gateway's own ASGI layers sit outside FastAPI's middleware stack, so a completion
never pays the framework's per-request frames and per-write `send` wrappers."""

from __future__ import annotations

from pathlib import Path

from starlette.middleware.errors import ServerErrorMiddleware

from areal_service.config import load_config
from gateway.app import create_app
from gateway.hotpath import HotRoutes
from gateway.throttle import AuthThrottleMiddleware


def _chain(app: object) -> list[type]:
    kinds = []
    while app is not None and len(kinds) < 12:
        kinds.append(type(app))
        app = getattr(app, "app", None)
    return kinds


def test_hot_routes_are_outside_the_framework_stack(tmp_path: Path) -> None:
    config = load_config(overrides=[f"data_dir={tmp_path}"])
    chain = _chain(create_app(config).build_middleware_stack())
    assert chain[:3] == [AuthThrottleMiddleware, HotRoutes, ServerErrorMiddleware], chain


def test_worker_header_is_outermost_with_several_workers(tmp_path: Path) -> None:
    config = load_config(overrides=[f"data_dir={tmp_path}", "gateway.scale.workers=2"])
    chain = _chain(create_app(config).build_middleware_stack())
    assert chain[0].__name__ == "_WorkerHeader"
    assert chain[1:3] == [AuthThrottleMiddleware, HotRoutes], chain
