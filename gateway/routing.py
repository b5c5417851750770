"""BackendPool: which backend serves a request, and whether any can.

Session-sticky routing (same session → same backend while it is healthy, for the prefix
cache), least-in-flight for new sessions, health state (a backend that refuses
connections or fails `unhealthy_after` health checks leaves rotation; a passing
`/health` re-admits it, after re-syncing its weights to the last swap), failover of
not-yet-started requests, and a bounded wait for a backend (BackendUnavailable → 503).
A down backend is probed with exponential backoff (`probe_interval_s` doubling up to
`max_probe_interval_s`), so a dead or restarting server (SGLang takes minutes to load)
is not hit four times a second by every waiting request's probe.
Fail fast: once no backend has been healthy for `fail_fast_s`, a new request gets
BackendUnavailable at once (after one probe, if one is due) instead of each waiting its
full deadline; a request arriving within the window still waits (a restart or a brief
blip is ridden out).
Owns one engine client (`gateway.backends.Backend`) per URL, made by the factory
`gateway.backends.factory.client_factory`; it cannot tell engines apart.

Router mode (`router_url`, `gateway.router.url`): generation goes through SGLang's router
(`sglang-router`), which does its own cache-aware routing, retries and worker health;
the session id goes along as `X-SMG-Routing-Key` (sticky under the router's `--policy
manual`). The pool's backends are then the router's WORKERS, re-listed (`GET /workers`)
at every health round: every weight-control call (pause / update / continue, the
weight-update group) goes to each of them, so swaps stay paired and versioned exactly as
without a router, and a worker the router newly lists (or one coming back) is re-synced
to the last swap at its first passing check. The router decides rotation, so a worker
can serve through it for up to one health interval before that re-sync; its tokens
carry the version that produced them either way. Readiness: the router entry is healthy
while its `/readiness` answers 200; a worker is reported healthy only while it and the
router both are (it serves this gateway only through the router).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from areal_service.config import ServiceConfig
from areal_service.serving_plan import ServingPlan
from areal_service.types import DEFAULT_POLICY
from gateway.backends import (
    Backend,
    BackendError,
    BackendUnavailable,
    Generation,
    GenerationDelta,
    RouterClient,
    SGLangClient,
    SwapCheck,
    SwapTimings,
)
from gateway.backends.factory import ClientFactory, client_factory
from gateway.backends.records import TokenRequest

log = logging.getLogger(__name__)


@dataclass
class PoolMember:
    """Mutable routing state of one backend (owned by the pool's event loop)."""

    url: str
    client: Backend
    healthy: bool = True
    in_flight: int = 0
    failed_checks: int = 0
    swapping: bool = False
    last_error: str = ""
    probe_backoff_s: float = 0.0
    """Wait before the next probe while down; 0 while healthy."""
    next_probe_at: float = 0.0
    """`time.monotonic()` before which a down backend is not probed."""


@dataclass(frozen=True, slots=True)
class BackendStatus:
    """A snapshot for the console and `/health` of the gateway."""

    url: str
    healthy: bool
    in_flight: int
    last_error: str
    failed_checks: int = 0
    """Consecutive failed `/health` checks (readiness reports a backend down at the first;
    routing takes it out after `unhealthy_after`)."""


class BackendPool:
    """Routes requests over `urls`; call `start()` for periodic health checks and
    `aclose()` to stop them and close the clients."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        timeout_s: float = 600.0,
        health_interval_s: float = 5.0,
        health_timeout_s: float = 10.0,
        unhealthy_after: int = 2,
        probe_interval_s: float = 0.25,
        max_probe_interval_s: float = 5.0,
        max_sticky_sessions: int = 100_000,
        fail_fast_s: float = 0.0,
        client_factory: ClientFactory | None = None,
        router_url: str | None = None,
    ) -> None:
        if not urls and not router_url:
            raise ValueError("BackendPool needs at least one backend URL (gateway.router.backends)")
        make = client_factory or (lambda url: SGLangClient(url, timeout_s=timeout_s))
        self._make = make
        self._backends = (
            []
            if router_url
            else [PoolMember(url=u.rstrip("/"), client=make(u.rstrip("/"))) for u in urls]
        )
        self.router: PoolMember | None = None
        """Router mode: the router, the one generation target (`_backends` are its
        workers, the weight-control targets)."""
        if router_url:
            url = router_url.rstrip("/")
            self.router = PoolMember(
                url=url,
                client=RouterClient(
                    url,
                    lambda: [b.client for b in self._backends if b.healthy],
                    timeout_s=timeout_s,
                ),
            )
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self.unhealthy_after = unhealthy_after
        self.probe_interval_s = probe_interval_s
        self.max_probe_interval_s = max(max_probe_interval_s, probe_interval_s)
        self.max_sticky_sessions = max_sticky_sessions
        self.fail_fast_s = fail_fast_s
        """0: never fail fast (every request waits its deadline)."""
        self.all_down_since: float | None = None
        """`time.monotonic()` when the last healthy backend went down; None while any is
        healthy."""
        self._sticky: OrderedDict[str, PoolMember] = OrderedDict()
        self._rr = 0
        self._probe_lock = asyncio.Lock()
        self._health_task: asyncio.Task[None] | None = None
        self.target: tuple[str, int] | None = None
        """(model_path, version) of the last swap; re-admitted backends are synced to it."""
        self.adapter_targets: dict[str, tuple[str, int]] = {}
        """Named policy -> (adapter path, version) of its last swap: a re-admitted
        backend is synced to every one of them too (`_resync`)."""
        self.may_swap: Callable[[], bool] = lambda: True
        """Whether this process may swap a returning backend itself (the leader among
        gateway processes); a follower re-admits it once the leader has synced it."""

    @classmethod
    def from_config(cls, config: ServiceConfig, policy: str | None = None) -> BackendPool:
        """The pool `config` asks for: `gateway.router.backends` (or the local engine), or
        the workers of `gateway.router.url` behind that router. `policy`: a full-weight
        policy's own pool, over its own engines (its `PolicyPlan.backend_urls`),
        which serve no adapter."""
        router = config.gateway.router
        router_url = router.url if policy is None else None
        if policy is not None:
            urls = list(ServingPlan(config)[policy].backend_urls)
        else:
            urls = [] if router_url else config.backend_urls()
        return cls(
            urls,
            timeout_s=router.request_timeout_s,
            health_interval_s=router.health_interval_s,
            fail_fast_s=router.no_backend_fail_fast_s,
            router_url=router_url,
            client_factory=client_factory(config, full_weights=policy is not None),
        )

    # -- state -------------------------------------------------------------------------
    @property
    def backends(self) -> list[PoolMember]:
        """The weight-control targets: the backends, or in router mode its workers."""
        return list(self._backends)

    @property
    def _serving(self) -> list[PoolMember]:
        """The generation targets: the backends, or the router."""
        return [self.router] if self.router is not None else self._backends

    def status(self) -> list[BackendStatus]:
        if self.router is None:
            return [
                BackendStatus(b.url, b.healthy, b.in_flight, b.last_error, b.failed_checks)
                for b in self._backends
            ]
        r = self.router
        up = r.healthy and r.failed_checks == 0
        return [
            BackendStatus(r.url, r.healthy, r.in_flight, r.last_error, r.failed_checks),
            *(
                BackendStatus(
                    b.url,
                    b.healthy and up,
                    b.in_flight,
                    b.last_error if up else "router down",
                    b.failed_checks if up else max(1, b.failed_checks),
                )
                for b in self._backends
            ),
        ]

    def mark_down(self, backend: PoolMember, reason: str) -> None:
        if backend.healthy:
            log.warning("backend %s out of rotation: %s", backend.url, reason)
            backend.probe_backoff_s = 0.0
            self._back_off(backend)
        backend.healthy = False
        backend.last_error = reason
        if self.all_down_since is None and not any(b.healthy for b in self._serving):
            self.all_down_since = self._now()

    def mark_up(self, backend: PoolMember) -> None:
        if not backend.healthy:
            log.info("backend %s back in rotation", backend.url)
        backend.healthy = True
        backend.failed_checks = 0
        backend.probe_backoff_s = backend.next_probe_at = 0.0
        if backend in self._serving:
            self.all_down_since = None

    def _back_off(self, backend: PoolMember) -> None:
        """Schedule the next probe of a down backend: the interval doubles per failure."""
        backend.probe_backoff_s = min(
            max(2 * backend.probe_backoff_s, self.probe_interval_s), self.max_probe_interval_s
        )
        backend.next_probe_at = self._now() + backend.probe_backoff_s

    @staticmethod
    def _now() -> float:
        return time.monotonic()

    def pick(self, session_id: str | None = None) -> PoolMember:
        """The session's backend while it is healthy, else the healthy backend with the
        fewest requests in flight (ties rotate). BackendUnavailable when none is healthy."""
        if self.router is not None:  # the router routes (session: its routing key)
            if not self.router.healthy:
                raise BackendUnavailable(f"router {self.router.url} is down")
            return self.router
        if session_id is not None and (b := self._sticky.get(session_id)) and b.healthy:
            self._sticky.move_to_end(session_id)
            return b
        healthy = [b for b in self._backends if b.healthy]
        if not healthy:
            raise BackendUnavailable(f"no healthy backend among {len(self._backends)}")
        start = self._rr % len(healthy)
        self._rr += 1
        best = min(healthy[start:] + healthy[:start], key=lambda b: b.in_flight)
        if session_id is not None:
            self._sticky[session_id] = best
            self._sticky.move_to_end(session_id)
            if len(self._sticky) > self.max_sticky_sessions:
                self._sticky.popitem(last=False)
        return best

    # -- waiting and leasing -----------------------------------------------------------
    async def wait_until_available(self, deadline_s: float) -> None:
        """Return once a backend is healthy, probing the down ones every
        `probe_interval_s`; BackendUnavailable after `deadline_s` seconds, or after one
        round of due probes when every backend has been down for `fail_fast_s`."""
        loop = asyncio.get_running_loop()
        end = loop.time() + deadline_s
        while not any(b.healthy for b in self._serving):
            remaining = end - loop.time()
            if remaining <= 0:
                raise BackendUnavailable(
                    f"no healthy backend among {len(self._serving)} after {deadline_s:g} s"
                )
            if not self._probe_lock.locked():
                async with self._probe_lock:
                    await self.check_health(only_down=True)
                if any(b.healthy for b in self._serving):
                    return
            if self.failing_fast():
                down_s = self._now() - (self.all_down_since or self._now())
                raise BackendUnavailable(
                    f"no healthy backend among {len(self._serving)} for {down_s:.0f} s"
                )
            await asyncio.sleep(min(self.probe_interval_s, max(0.0, end - loop.time())))

    def failing_fast(self) -> bool:
        """Whether no backend has been healthy for `fail_fast_s` (new requests get 503
        at once)."""
        return (
            self.fail_fast_s > 0
            and self.all_down_since is not None
            and self._now() - self.all_down_since >= self.fail_fast_s
        )

    @contextlib.asynccontextmanager
    async def lease(
        self, session_id: str | None = None, *, deadline_s: float = 30.0
    ) -> AsyncIterator[PoolMember]:
        """A backend for one request, counted in flight until the block exits."""
        await self.wait_until_available(deadline_s)
        backend = self.pick(session_id)
        backend.in_flight += 1
        try:
            yield backend
        finally:
            backend.in_flight -= 1

    # -- requests with failover --------------------------------------------------------
    async def generate_interruptible(
        self, request: TokenRequest, *, session_id: str | None = None, deadline_s: float = 30.0
    ) -> Generation:
        """`Backend.generate_interruptible` on the routed backend; a refused
        connection takes that backend out and retries on another until `deadline_s`."""
        loop = asyncio.get_running_loop()
        end = loop.time() + deadline_s
        while True:
            async with self.lease(session_id, deadline_s=max(0.0, end - loop.time())) as b:
                try:
                    return await b.client.generate_interruptible(
                        request, routing_key=self._routing_key(session_id)
                    )
                except BackendUnavailable as e:
                    if e.sent:
                        raise
                    self.mark_down(b, e.message)

    async def generate_interruptible_stream(
        self, request: TokenRequest, *, session_id: str | None = None, deadline_s: float = 30.0
    ) -> AsyncGenerator[GenerationDelta, None]:
        """Streaming variant; failover only before the first delta was yielded."""
        loop = asyncio.get_running_loop()
        end = loop.time() + deadline_s
        while True:
            started = False
            async with self.lease(session_id, deadline_s=max(0.0, end - loop.time())) as b:
                try:
                    async with contextlib.aclosing(
                        b.client.generate_interruptible_stream(
                            request, routing_key=self._routing_key(session_id)
                        )
                    ) as deltas:
                        async for delta in deltas:
                            started = True
                            yield delta
                    return
                except BackendUnavailable as e:
                    if e.sent or started:
                        raise
                    self.mark_down(b, e.message)

    def _routing_key(self, session_id: str | None) -> str | None:
        return session_id if self.router is not None else None

    # -- health ------------------------------------------------------------------------
    async def refresh_workers(self) -> None:
        """Router mode: adopt the router's current worker list. A newly listed worker
        starts down and due for a probe (admitted after its re-sync); one no longer
        listed is dropped. The list is kept when the router cannot answer."""
        if self.router is None:
            return
        assert isinstance(self.router.client, RouterClient)
        try:
            urls = await self.router.client.list_workers()
        except BackendError as e:
            log.debug("router %s: cannot list workers: %s", self.router.url, e.message)
            return
        known = {b.url: b for b in self._backends}
        fresh = [
            known.get(u) or PoolMember(url=u, client=self._make(u), healthy=False) for u in urls
        ]
        gone = [b for b in self._backends if b.url not in set(urls)]
        for b in fresh:
            if b.url not in known:
                log.info("router %s lists worker %s", self.router.url, b.url)
        for b in gone:
            log.warning("router %s no longer lists worker %s", self.router.url, b.url)
            await b.client.aclose()
        self._backends = fresh

    async def check_health(self, *, only_down: bool = False) -> None:
        """One round of `/health` on every backend (or only the down ones) not swapping;
        a down backend only once its backoff has passed. Router mode: the router's
        readiness too, after re-listing its workers."""
        if self.router is not None and not only_down:
            await self.refresh_workers()
        now = self._now()
        targets = [
            b
            for b in self._every_client_owner()
            if not b.swapping
            and not (only_down and b.healthy)
            and (b.healthy or now >= b.next_probe_at)
        ]
        results = await asyncio.gather(*(b.client.health(self.health_timeout_s) for b in targets))
        for b, ok in zip(targets, results, strict=True):
            if not ok:
                b.failed_checks += 1
                if not b.healthy:
                    self._back_off(b)
                elif b.failed_checks >= self.unhealthy_after:
                    self.mark_down(b, f"/health failed {b.failed_checks}x")
            elif b.healthy:
                b.failed_checks = 0
            elif await self._resync(b):
                self.mark_up(b)
            else:
                self._back_off(b)

    async def _resync(self, b: PoolMember) -> bool:
        """Bring a returning backend to the last swapped version, and each named policy's
        adapter to its last swapped version, before re-admitting it. An engine that
        restarted lost its adapters; one that was away missed their swaps. One
        `/model_info` call says both (`adapter_versions`); only what differs is loaded."""
        if (self.target is None and not self.adapter_targets) or b is self.router:
            return True
        name = "the live versions"
        try:
            info = await b.client.model_info()
            stale: list[tuple[str | None, str, int]] = []
            if self.target is not None and info.weight_version != str(self.target[1]):
                stale.append((None, *self.target))
            stale.extend(
                (policy, path, version)
                for policy, (path, version) in sorted(self.adapter_targets.items())
                if info.adapter_versions.get(policy) != str(version)
            )
            for policy, path, version in stale:
                name = f"v{version}" if policy is None else f"policy {policy} v{version}"
                if not self.may_swap():
                    b.last_error = f"waiting for the leader to sync it to {name}"
                    return False
                await b.client.swap_weights(path, version, policy)
        except BackendError as e:
            b.last_error = f"resync to {name} failed: {e.message}"
            return False
        return True

    async def _health_loop(self) -> None:
        if self.router is not None:  # learn the workers now, not one interval later
            async with self._probe_lock:
                await self.check_health()
        while True:
            await asyncio.sleep(self.health_interval_s)
            async with self._probe_lock:
                await self.check_health()

    async def start(self) -> None:
        """Start periodic health checks (a task on the running loop)."""
        if self._health_task is None:
            self._health_task = asyncio.get_running_loop().create_task(self._health_loop())

    async def aclose(self) -> None:
        """Stop health checks and close every client."""
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
            self._health_task = None
        for b in self._every_client_owner():
            await b.client.aclose()

    def _every_client_owner(self) -> tuple[PoolMember, ...]:
        """The backends and, in router mode, the router's own entry."""
        return (*self._backends, *([self.router] if self.router else ()))

    # -- weights -----------------------------------------------------------------------
    async def swap_weights(
        self,
        model_path: str,
        version: int,
        lora_name: str | None = None,
        check: SwapCheck | None = None,
    ) -> dict[str, SwapTimings]:
        """`swap_weights` on every healthy backend concurrently. An unreachable backend
        is taken out (and re-synced when it comes back); one that rejects the load keeps
        serving its old weights (its tokens say so). Raises if every backend failed.
        `lora_name`: only that policy's adapter (`Backend.swap_adapter`: no pause, no
        other policy's request is touched); a returning backend is re-synced to it.
        `check`: the swap canary each backend runs where it can still refuse unseen
        (`Backend.swap_weights`)."""
        healthy = [b for b in self._backends if b.healthy]
        for b in healthy:
            b.swapping = True
        try:
            results = await asyncio.gather(
                *(b.client.swap_weights(model_path, version, lora_name, check) for b in healthy),
                return_exceptions=True,
            )
        finally:
            for b in healthy:
                b.swapping = False
        timings: dict[str, SwapTimings] = {}
        errors: list[BackendError] = []
        for b, r in zip(healthy, results, strict=True):
            if isinstance(r, SwapTimings):
                timings[b.url] = r
            elif isinstance(r, BackendUnavailable):
                errors.append(r)
                self.mark_down(b, f"swap to v{version} failed: {r.message}")
            elif isinstance(r, BackendError):
                errors.append(r)
                b.last_error = f"swap to v{version} failed: {r.message}"
            else:
                raise r
        if errors and not timings:
            raise errors[0]
        if lora_name in (None, DEFAULT_POLICY):  # re-synced by the paired swap
            self.target = (model_path, version)
        else:
            self.adapter_targets[lora_name] = (model_path, version)
        return timings

    def retire_policy(self, policy: str) -> int:
        """`policy` was deleted: each backend's client unloads its adapter where the engine
        can (`Backend.retire_policy`); how many backends do."""
        self.adapter_targets.pop(policy, None)
        return sum(b.client.retire_policy(policy) for b in self._backends)

    def adopt_adapter(self, policy: str | None, version: int) -> None:
        """A follower's side of a leader's versioned adapter swap: every backend's client
        sends `policy`'s (None: the default policy's) new requests under `version`
        (`Backend.adopt_adapter`; nothing for clients without versioned adapters)."""
        for b in self._backends:
            b.client.adopt_adapter(policy, version)
