"""The gateway's own ASGI layers sit outside FastAPI's middleware stack, so a completion
never pays the framework's per-request frames and per-write `send` wrappers."""

from __future__ import annotations

from pathlib import Path

import httpx
from starlette.middleware.errors import ServerErrorMiddleware
from support.harness import ADMIN_KEY, run_gateway

from areal_service.config import load_config
from engine.echo_backend import start_echo_backend
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


def test_hot_routes_skip_fastapis_per_request_telemetry_check(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """FastAPI's `__call__` reads the environment for an OpenTelemetry provider on every
    request (~5 µs); a completion never enters it, any other route still does."""
    with (
        start_echo_backend(tokens=4) as backend,
        run_gateway(tmp_path, tiny_model_dir, [backend.url]) as gw,
    ):
        telemetry = gw.app._native_telemetry  # type: ignore[attr-defined]
        checks: list[str] = []
        real = telemetry.enabled
        telemetry.enabled = lambda: checks.append("checked") or real()
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        r = httpx.post(
            f"{gw.v1}/chat/completions",
            headers=admin,
            timeout=30,
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        )
        assert r.status_code == 200, r.text
        assert checks == []
        assert httpx.get(f"{gw.url}/health/liveness", timeout=10).status_code == 200
        assert checks == ["checked"]


def test_wrong_keys_on_a_hot_route_lock_the_address_out(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """The hot routes count their own 401s (their `send` is not wrapped for it)."""
    with (
        start_echo_backend(tokens=4) as backend,
        run_gateway(
            tmp_path,
            tiny_model_dir,
            [backend.url],
            "gateway.auth.free_failures=2",
            "gateway.auth.backoff_s=30",
        ) as gw,
    ):
        wrong = {"Authorization": "Bearer sk-guess"}
        codes = [
            httpx.post(f"{gw.v1}/chat/completions", headers=wrong, json={}, timeout=30).status_code
            for _ in range(4)
        ]
        assert codes == [401, 401, 401, 429]
