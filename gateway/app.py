"""`create_app(config)`: the gateway's FastAPI app. Its lifespan builds the store, the
group-commit writer, the key resolver, the backend pool and the tokenizer, and tears
them down in reverse order (the writer drains before the store closes).
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Send

from areal_service.config import ServiceConfig, with_admin_key
from areal_service.keys import admin_key_matches
from areal_service.store import TrajectoryStore
from areal_service.store.linking import ParentLinker
from areal_service.store.writer import GroupCommitWriter
from gateway import console
from gateway.auth import KeyResolver, flush_key_usage, write_key_usage
from gateway.cache import RefreshingCache
from gateway.console import policy_form
from gateway.errors import OpenAIError, install_error_handlers, invalid_api_key
from gateway.hotpath import HotRoutes
from gateway.leader import Leadership
from gateway.limits import sync_key_limits
from gateway.policies import refresh_policies, run_policy_refresher
from gateway.policy_pools import build_pools
from gateway.routes import admin, health, openai, rewards, rl
from gateway.state import GatewayState
from gateway.stopping import watch_exit_signals
from gateway.throttle import (
    AuthThrottle,
    AuthThrottleMiddleware,
    Scope,
    request_token,
    sync_auth_failures,
)
from gateway.tokenizer import ChatTokenizer
from gateway.weight_sync import run_weight_syncer

log = logging.getLogger(__name__)

SESSION_TTL_S = 1.0
"""How long a session read is trusted outright (another replica may end it)."""
SESSION_STALE_S = 30.0
"""How long a session read may be served while one reload refreshes it."""
_GC_YOUNG_THRESHOLD = 10_000
"""Net container allocations between young collections (CPython's default: 700)."""


def context_length_of(config: ServiceConfig, tokenizer_dir: Path) -> int:
    """Prompt + output limit: the engine's setting, else the checkpoint's
    `max_position_embeddings` (read from config.json, no model load)."""
    if config.engine.context_length:
        return config.engine.context_length
    cfg = tokenizer_dir / "config.json"
    if cfg.exists():
        data = json.loads(cfg.read_text())
        for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
            if isinstance(data.get(key), int):
                return int(data[key])
    return 32768


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


async def sweep_idle_sessions(state: GatewayState) -> None:
    """End sessions idle past `gateway.sessions.idle_timeout_s`, forever (cancelled at
    shutdown), while this process is the leader. A failed sweep is logged and retried at
    the next interval."""
    gw = state.config.gateway
    while True:
        await asyncio.sleep(gw.sessions.sweep_interval_s)
        if not state.leadership.is_leader:
            continue  # the leader sweeps; this process's caches see its ends in ttl_s
        try:
            ended = await asyncio.to_thread(
                state.store.end_idle_sessions, gw.sessions.idle_timeout_s
            )
        except Exception:  # the database may be briefly unavailable; try again later
            log.exception("idle-session sweep failed")
            continue
        for session_id in ended:
            state.linker.forget(session_id)
            state.session_cache.forget(session_id)
        if ended:
            log.info("ended %d idle sessions", len(ended))


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

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        config = with_admin_key(given, binding=True)  # DefaultAdminKeyError: not started
        config.data_dir.mkdir(parents=True, exist_ok=True)
        gw = config.gateway
        app.state.auth_throttle = AuthThrottle(
            free_failures=gw.auth.free_failures,
            backoff_s=gw.auth.backoff_s,
            max_backoff_s=gw.auth.max_backoff_s,
        )
        store = await asyncio.to_thread(TrajectoryStore.open, config.database_url(), config.store)
        # Other processes write this store's sessions too (workers, replicas): parent
        # links are read from the store, once per write batch on the writer's thread.
        shared = gw.shares_store()
        linker = ParentLinker(store, max_sessions=0 if shared else 4096)
        writer = GroupCommitWriter.from_config(
            store, config.store, prepare=linker.link_batch if shared else None
        )
        writer.start()
        tokenizer_dir = Path(config.gateway.tokenizer or config.model_dir())
        tokenizer = await asyncio.to_thread(
            ChatTokenizer.from_pretrained,
            tokenizer_dir,
            chat_template=config.engine.chat_template,
            tool_parser=gw.tool_parser,
            reasoning_parser=gw.reasoning_parser,
        )
        leadership = Leadership(store, ttl_s=gw.scale.leader_lease_s)
        await leadership.renew()  # a lone gateway leads from its first request on
        # The backends (or a router's workers), and a pool per full-weight policy.
        pools = build_pools(config, lambda: leadership.is_leader)
        await pools.start()
        app.state.gateway = GatewayState(
            config=config,
            store=store,
            writer=writer,
            keys=KeyResolver(
                store,
                config.gateway.auth.admin_key.get_secret_value(),
                usage_interval_s=config.gateway.auth.key_usage_interval_s,
            ),
            backends=pools.main,
            policy_pools=pools.policies,
            tokenizer=tokenizer,
            context_length=context_length_of(config, tokenizer_dir),
            linker=linker,
            leadership=leadership,
            session_cache=RefreshingCache(
                store.get_sessions, ttl_s=SESSION_TTL_S, stale_s=SESSION_STALE_S
            ),
            started_at=time.time(),
        )
        await refresh_policies(app.state.gateway)  # the runtime ones, before serving
        restore_signals = watch_exit_signals(app.state.gateway.stopping)
        log.info("gateway serving %s from %s", config.gateway.model_name, config.backend_urls())
        if freeze_gc:
            gc.collect()
            gc.freeze()
            gc.set_threshold(_GC_YOUNG_THRESHOLD, 20, 100)
        tasks = [
            asyncio.create_task(leadership.run()),
            asyncio.create_task(sweep_idle_sessions(app.state.gateway)),
            asyncio.create_task(run_weight_syncer(app.state.gateway)),
            asyncio.create_task(run_policy_refresher(app.state.gateway)),
            asyncio.create_task(
                flush_key_usage(
                    app.state.gateway.keys.usage, store, config.gateway.auth.key_usage_interval_s
                )
            ),
        ]
        keys = app.state.gateway.keys
        if shared:  # per-key limits and the auth throttle count every process
            tasks.append(
                asyncio.create_task(
                    sync_key_limits(
                        keys.limits,
                        keys.usage.unflushed_tokens,
                        store.coordination,
                        leadership.holder,
                        gw.limits.key_limits_sync_s,
                    )
                )
            )
            tasks.append(
                asyncio.create_task(
                    sync_auth_failures(
                        app.state.auth_throttle,
                        store.coordination,
                        leadership.holder,
                        gw.auth.throttle_sync_s,
                    )
                )
            )
        try:
            yield
        finally:
            restore_signals()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await leadership.release()
            await write_key_usage(keys.usage, store)
            if shared:
                try:
                    await asyncio.to_thread(store.coordination.forget_key_counts, leadership.holder)
                except Exception as e:  # noqa: BLE001 - they age out in five intervals
                    log.warning("could not delete this process's key counts: %s", e)
            app.state.gateway.large_prompts.close()
            await pools.aclose()
            await asyncio.to_thread(writer.stop)
            store.close()

    # strict_content_type off: a JSON body without a content-type (as `curl -d` users and
    # the hot routes' clients may send) is parsed as JSON, not refused.
    app = GatewayApp(
        title="AReaL Service gateway",
        lifespan=lifespan,
        docs_url="/docs",
        redoc_url=None,
        strict_content_type=False,
    )
    install_error_handlers(app)
    app.include_router(openai.router)
    app.include_router(openai.docs_router)  # schema only: HotRoutes answers these paths
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
            self_reporting=openai.HOT_ROUTES,
        )
    )
    outer.append(lambda inner: HotRoutes(inner, routes=openai.HOT_ROUTES))
    app.outer_layers = tuple(outer)
    app.hot_paths = frozenset(openai.HOT_ROUTES)
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
