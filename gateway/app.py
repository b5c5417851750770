"""`create_app(config)`: the gateway's FastAPI app: its routes and layers. Its lifespan
(`gateway/lifecycle.py`) builds the store, the group-commit writer, the tokenizer, the
backend pools and the state in named steps, supervises the background tasks, and tears
everything down in reverse order (the writer drains before the store closes).
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Send

from areal_service.config import ServiceConfig
from areal_service.keys import admin_key_matches
from gateway import console
from gateway.console import policy_form
from gateway.errors import OpenAIError, install_error_handlers, invalid_api_key
from gateway.hotpath import HotRoutes
from gateway.lifecycle import GatewayLife
from gateway.routes import admin, health, models, rewards, rl
from gateway.state import GatewayState
from gateway.throttle import (
    AuthThrottle,
    AuthThrottleMiddleware,
    Scope,
    request_token,
)
from gateway.wires import routes as wire_routes

log = logging.getLogger(__name__)


class _RequestId:
    """ASGI middleware: every response carries `x-request-id` (routes that name a stored
    completion set it themselves; others get a fresh id). Pure ASGI, no per-request task."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = message.setdefault("headers", [])
                if not any(k == b"x-request-id" for k, _ in headers):
                    headers.append((b"x-request-id", f"req_{uuid.uuid4().hex}".encode()))
            await send(message)

        await self.app(scope, receive, send_with_id)


class _WorkerHeader:
    """ASGI middleware, with several workers only: `x-areal-worker: <pid>` on every
    response names the process that answered (operators and tests tell workers apart)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.header = (b"x-areal-worker", str(os.getpid()).encode())  # built in the worker

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_worker(message: Message) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", []).append(self.header)
            await send(message)

        await self.app(scope, receive, send_with_worker)


DOCS_PATHS = frozenset({"/docs", "/docs/oauth2-redirect", "/openapi.json"})
METRICS_PATH = "/metrics"


class _AdminOnlyPaths:
    """ASGI middleware: `/docs`, `/openapi.json` and `/metrics` need the admin key as a
    bearer token unless `gateway.auth.public_docs` / `gateway.auth.public_metrics` is set. Any
    other token is 401 (counted by the auth throttle: no guessing the admin key here)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        state: GatewayState | None = (
            getattr(scope["app"].state, "gateway", None)
            if path in DOCS_PATHS or path == METRICS_PATH
            else None
        )
        if state is not None:
            gw = state.config.gateway
            public = gw.auth.public_docs if path in DOCS_PATHS else gw.auth.public_metrics
            token = request_token(scope)
            if not public and not (
                token and admin_key_matches(token, gw.auth.admin_key.get_secret_value())
            ):
                error = (
                    invalid_api_key(token)
                    if token
                    else OpenAIError(
                        401,
                        f"{path} needs the admin key as a bearer token (or set "
                        f"gateway.auth.{'public_docs' if path in DOCS_PATHS else 'public_metrics'})",
                        code="admin_required",
                    )
                )
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _throttle_of(scope: Scope) -> AuthThrottle | None:
    throttle: AuthThrottle | None = getattr(scope["app"].state, "auth_throttle", None)
    return throttle


def _known_good_of(scope: Scope) -> Callable[[str], bool] | None:
    state: GatewayState | None = getattr(scope["app"].state, "gateway", None)
    return None if state is None else state.keys.known_good


def create_app(given: ServiceConfig, *, freeze_gc: bool = False) -> FastAPI:
    """The gateway app for `config`; nothing is built until the lifespan starts.

    `freeze_gc` (the served process, `run_gateway`): once startup is done, move every
    object to the GC's permanent generation and raise the young-generation threshold.
    About 130k objects exist by then (FastAPI, SQLAlchemy, pydantic models, the
    tokenizer; no torch: the tokenizer loads without it); a full collection walks them
    all, tens of ms on 2 cores (AReaL's proxy, with ~810k, paused ~0.5 s: its p99
    spikes). With the default threshold (700) the 64 requests in flight were collected
    ~1300 times per 5k requests, promoting their short-lived objects into gen 1/2 scans:
    0.25 ms of GC per request, gen-2 pauses up to 40 ms. With 10k, GC is ~0.05 ms a
    request.
    Off in tests, where many apps share one process.

    The default admin key is replaced at start (`areal_service/admin_key.py`): by the
    data dir's generated key on loopback; anywhere else the lifespan raises
    `DefaultAdminKeyError` and the server does not start."""

    # strict_content_type off: a JSON body without a content-type (as `curl -d` users and
    # the hot routes' clients may send) is parsed as JSON, not refused.
    life = GatewayLife(given, freeze_gc=freeze_gc)
    app = GatewayApp(
        title="AReaL Service gateway",
        lifespan=life.lifespan,
        docs_url="/docs",
        redoc_url=None,
        strict_content_type=False,
    )
    app.state.life = life  # readiness reads its supervisor
    install_error_handlers(app)
    app.include_router(models.router)
    app.include_router(wire_routes.docs_router)  # schema only: HotRoutes answers these paths
    app.include_router(rl.router)
    app.include_router(rewards.router)
    app.include_router(admin.router)
    app.include_router(health.router)
    app.include_router(policy_form.router)  # before /console/policies/{name} routes
    app.include_router(console.router)
    app.add_middleware(_AdminOnlyPaths)
    app.add_middleware(_RequestId)
    outer: list[Callable[[ASGIApp], ASGIApp]] = []
    if given.gateway.scale.workers > 1:  # outermost: even a throttled reply names it
        outer.append(_WorkerHeader)
    outer.append(
        lambda inner: AuthThrottleMiddleware(
            inner,
            throttle_of=_throttle_of,
            known_good_of=_known_good_of,
            self_reporting=wire_routes.HOT_ROUTES,
        )
    )
    outer.append(lambda inner: HotRoutes(inner, routes=wire_routes.HOT_ROUTES))
    app.outer_layers = tuple(outer)
    app.hot_paths = frozenset(wire_routes.HOT_ROUTES)
    return app


class GatewayApp(FastAPI):
    """FastAPI with the gateway's own layers OUTSIDE the framework's middleware stack.

    `add_middleware` puts a layer inside Starlette's ServerErrorMiddleware and, in recent
    FastAPI versions, its telemetry and body-limit layers too: each costs the hot routes a
    coroutine frame per request and a `send` wrapper per streamed write. The hot routes
    answer their own errors (the route's shape, a logged 500 for a bug, `x-request-id`
    on every reply), so they need none of it: `outer_layers` (outermost first) wrap the
    built stack, and a completion never enters the framework. Every other request goes
    on through it unchanged. Starlette sets `scope["app"]` before calling the stack, so
    the layers still find the app's state there."""

    outer_layers: tuple[Callable[[ASGIApp], ASGIApp], ...] = ()
    hot_paths: frozenset[str] = frozenset()
    """Paths `__call__` hands straight to the built stack (the hot routes)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # FastAPI's own `__call__` asks its native OpenTelemetry hook whether a tracer,
        # meter or logger provider is configured, on every request: ~5 µs of environment
        # reads per completion (py-spy: 1% of the gateway's GIL time at zero delay). The
        # hot routes export Prometheus metrics instead and skip it, as they skip the
        # framework's telemetry middleware; every other request goes through it.
        if scope["type"] == "http" and scope["path"] in self.hot_paths and not self.root_path:
            scope["app"] = self  # what Starlette's `__call__` sets (the layers read it)
            if self.middleware_stack is None:
                self.middleware_stack = self.build_middleware_stack()
            await self.middleware_stack(scope, receive, send)
            return
        await super().__call__(scope, receive, send)

    def build_middleware_stack(self) -> ASGIApp:
        stack = super().build_middleware_stack()
        for wrap in reversed(self.outer_layers):
            stack = wrap(stack)
        return stack
