"""One gateway's life: start-up as a list of named steps, its background tasks under a
supervisor (`gateway/supervisor.py`), and shutdown in the reverse order of start-up.

Each step builds one part and registers that part's teardown on the exit stack, so the
parts started are stopped in reverse whether start-up finished or failed half-way (the
writer drains before the store closes; the background tasks stop first).
"""

from __future__ import annotations

import asyncio
import functools
import gc
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

from fastapi import FastAPI

from areal_service.config import ServiceConfig, with_admin_key
from areal_service.store import TrajectoryStore
from areal_service.store.linking import ParentLinker
from areal_service.store.writer import GroupCommitWriter
from gateway.auth import KeyResolver, flush_key_usage, write_key_usage
from gateway.cache import RefreshingCache
from gateway.leader import Leadership
from gateway.limits import sync_key_limits
from gateway.policies import check_key_policy, refresh_policies, run_policy_refresher
from gateway.policy_pools import Pools, build_pools
from gateway.state import GatewayState
from gateway.stopping import watch_exit_signals
from gateway.supervisor import Supervisor
from gateway.throttle import AuthThrottle, sync_auth_failures
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


Step = Callable[[AsyncExitStack], Awaitable[None]]


class GatewayLife:
    """The parts of one gateway app, built by `steps` in order when its lifespan starts
    and torn down in reverse when it ends. `supervisor` runs the background tasks;
    readiness reports its `problems`."""

    config: ServiceConfig
    store: TrajectoryStore
    writer: GroupCommitWriter
    linker: ParentLinker
    tokenizer: ChatTokenizer
    tokenizer_dir: Path
    leadership: Leadership
    pools: Pools
    state: GatewayState

    app: FastAPI

    def __init__(self, given: ServiceConfig, *, freeze_gc: bool = False) -> None:
        self.given = given
        self.freeze_gc = freeze_gc
        self.supervisor = Supervisor()

    def steps(self) -> tuple[Step, ...]:
        """Start-up, in order."""
        return (
            self.settle_config,
            self.open_store,
            self.start_writer,
            self.load_tokenizer,
            self.take_leadership,
            self.start_backends,
            self.build_state,
            self.load_runtime_policies,
            self.watch_exit_signals,
            self.freeze_objects,
            self.start_background_tasks,
        )

    @asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        """The app's lifespan: every step, serve, then every teardown in reverse."""
        self.app = app
        async with AsyncExitStack() as stack:
            for step in self.steps():
                await step(stack)
            log.info(
                "gateway serving %s from %s",
                self.config.gateway.model_name,
                self.config.backend_urls(),
            )
            yield

    # ------------------------------------------------------------------ the steps

    async def settle_config(self, _: AsyncExitStack) -> None:
        """The admin key settled (`areal_service/admin_key.py`: DefaultAdminKeyError, and
        the server does not start, off loopback), the data dir made, the auth throttle."""
        self.config = config = with_admin_key(self.given, binding=True)
        config.data_dir.mkdir(parents=True, exist_ok=True)
        auth = config.gateway.auth
        self.app.state.auth_throttle = AuthThrottle(
            free_failures=auth.free_failures,
            backoff_s=auth.backoff_s,
            max_backoff_s=auth.max_backoff_s,
        )

    async def open_store(self, stack: AsyncExitStack) -> None:
        self.store = await asyncio.to_thread(
            TrajectoryStore.open, self.config.database_url(), self.config.store
        )
        stack.callback(self.store.close)

    async def start_writer(self, stack: AsyncExitStack) -> None:
        """The group-commit writer. Other processes write this store's sessions too
        (workers, replicas): parent links are then read from the store, once per write
        batch on the writer's thread."""
        shared = self.config.gateway.shares_store()
        self.linker = ParentLinker(self.store, max_sessions=0 if shared else 4096)
        self.writer = GroupCommitWriter.from_config(
            self.store, self.config.store, prepare=self.linker.link_batch if shared else None
        )
        self.writer.start()
        stack.push_async_callback(asyncio.to_thread, self.writer.stop)
        self.supervisor.watch("store_writer", self._writer_problem)

    async def load_tokenizer(self, _: AsyncExitStack) -> None:
        gw = self.config.gateway
        self.tokenizer_dir = Path(gw.tokenizer or self.config.model_dir())
        self.tokenizer = await asyncio.to_thread(
            ChatTokenizer.from_pretrained,
            self.tokenizer_dir,
            chat_template=self.config.engine.chat_template,
            tool_parser=gw.tool_parser,
            reasoning_parser=gw.reasoning_parser,
        )

    async def take_leadership(self, stack: AsyncExitStack) -> None:
        """The leader lease: a lone gateway leads from its first request on."""
        self.leadership = Leadership(self.store, ttl_s=self.config.gateway.scale.leader_lease_s)
        await self.leadership.renew()
        stack.push_async_callback(self.leadership.release)

    async def start_backends(self, stack: AsyncExitStack) -> None:
        """The backends (or a router's workers), and a pool per full-weight policy
        (`policies[].weights: full`) on its own engines."""
        self.pools = build_pools(self.config, lambda: self.leadership.is_leader)
        await self.pools.start()
        stack.push_async_callback(self.pools.aclose)

    async def build_state(self, stack: AsyncExitStack) -> None:
        """The `GatewayState` request code reaches; its key usage is written at the end."""
        config = self.config
        auth = config.gateway.auth
        self.state = self.app.state.gateway = GatewayState(
            config=config,
            store=self.store,
            writer=self.writer,
            keys=KeyResolver(
                self.store,
                auth.admin_key.get_secret_value(),
                usage_interval_s=auth.key_usage_interval_s,
            ),
            backends=self.pools.main,
            policy_pools=self.pools.policies,
            tokenizer=self.tokenizer,
            context_length=context_length_of(config, self.tokenizer_dir),
            linker=self.linker,
            leadership=self.leadership,
            session_cache=RefreshingCache(
                self.store.get_sessions, ttl_s=SESSION_TTL_S, stale_s=SESSION_STALE_S
            ),
            started_at=time.time(),
        )
        stack.callback(self.state.large_prompts.close)
        if config.gateway.shares_store():
            stack.push_async_callback(self._forget_key_counts)
        stack.push_async_callback(write_key_usage, self.state.keys.usage, self.store)

    async def load_runtime_policies(self, _: AsyncExitStack) -> None:
        """The policies created at runtime, before the first request; from then on a key
        whose policy is deleted is refused."""
        await refresh_policies(self.state)
        self.state.keys.check_policy = functools.partial(check_key_policy, self.state)

    async def watch_exit_signals(self, stack: AsyncExitStack) -> None:
        """SIGINT/SIGTERM set `state.stopping` first (`gateway/stopping.py`)."""
        stack.callback(watch_exit_signals(self.state.stopping))

    async def freeze_objects(self, _: AsyncExitStack) -> None:
        """With `freeze_gc` (see `create_app`): every object so far into the GC's
        permanent generation, and a higher young-generation threshold."""
        if self.freeze_gc:
            gc.collect()
            gc.freeze()
            gc.set_threshold(_GC_YOUNG_THRESHOLD, 20, 100)

    async def start_background_tasks(self, stack: AsyncExitStack) -> None:
        """Every background task, supervised; stopped first at shutdown."""
        state, store, gw = self.state, self.store, self.config.gateway
        keys, holder = state.keys, self.leadership.holder
        start = self.supervisor.start
        start("leader_lease", self.leadership.run)
        start("session_sweep", lambda: sweep_idle_sessions(state))
        start("weight_sync", lambda: run_weight_syncer(state))
        start("policy_refresh", lambda: run_policy_refresher(state))
        start(
            "key_usage_flush",
            lambda: flush_key_usage(keys.usage, store, gw.auth.key_usage_interval_s),
        )
        if gw.shares_store():  # per-key limits and the auth throttle count every process
            throttle = self.app.state.auth_throttle
            start(
                "key_limits_sync",
                lambda: sync_key_limits(
                    keys.limits,
                    keys.usage.unflushed_tokens,
                    store.coordination,
                    holder,
                    gw.limits.key_limits_sync_s,
                ),
            )
            start(
                "auth_failures_sync",
                lambda: sync_auth_failures(
                    throttle, store.coordination, holder, gw.auth.throttle_sync_s
                ),
            )
        stack.push_async_callback(self.supervisor.stop)

    # ------------------------------------------------------------------ teardown helpers

    async def _forget_key_counts(self) -> None:
        try:
            await asyncio.to_thread(
                self.store.coordination.forget_key_counts, self.leadership.holder
            )
        except Exception as e:  # noqa: BLE001 - they age out in five intervals
            log.warning("could not delete this process's key counts: %s", e)

    def _writer_problem(self) -> str | None:
        return None if self.writer.running else "the store writer thread ended"
