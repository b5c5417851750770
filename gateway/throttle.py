"""Throttling of credential guessing per client address (console logins, bearer tokens).

`AuthThrottle` counts failures per address: after `free_failures`, the address is
locked out for `backoff_s`, doubling with each further failure up to `max_backoff_s`; a
record with no failure for `max_backoff_s` past its lock-out is forgotten.
`AuthThrottleMiddleware` (outermost ASGI layer) applies it to every route, hot ones
included, at the cost of one dict lookup per request:

- a failure is a 401 answered to a request that carried a token (`authorization` or
  `x-api-key`), or a 401 from `POST /console/login` (a wrong admin key);
- while an address is locked out, a console login post or a request carrying a token
  that is not already known good (the admin key, or a key the resolver holds cached as
  valid: these pass without a look) is still checked, and a wrong one is answered 429
  in the OpenAI shape with `retry-after` instead of 401. The lock-out never refuses a
  right key: the admin signing in, or an agent whose valid key this process has not
  seen yet, is served even from a locked-out address. Agents on the same host keep
  working while one misconfigured (or hostile) client there is locked out. (Generated
  keys are random 192-bit secrets: set a long random admin key too.)

The address is the TCP peer (`scope["client"]`): `x-forwarded-for` is trusted only from
the proxies named in `gateway.auth.forwarded_allow_ips` (none by default; uvicorn's proxy
middleware rewrites the peer only for those).
Counted in memory. With several gateway processes on one store (workers, replicas) each
publishes the counts that changed and reads the others' every
`gateway.auth.throttle_sync_s` (`sync_auth_failures`,
`areal_service/store/auth_failures.py`): an address is locked out on its failures summed
over every process, everywhere, within one sync interval. Until then each process locks
it out on what it has seen itself.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Collection, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any, Protocol

from areal_service.types import AuthFailures
from gateway.auth import token_of
from gateway.errors import OpenAIError
from gateway.limits import rate_limited

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
KnownGood = Callable[[str], bool]

LOGIN_PATH = "/console/login"
log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Record:
    failures: int = 0
    locked_until: float = 0.0
    last_failure: float = 0.0


class AuthThrottle:
    """Failure counts and lock-outs per client address (bounded: `max_addresses`): this
    process's own, and the other processes' sharing the store (`apply_peers`). Times are
    `time.monotonic()` seconds; the exchange with the store converts to wall clock."""

    def __init__(
        self,
        *,
        free_failures: int = 5,
        backoff_s: float = 1.0,
        max_backoff_s: float = 300.0,
        max_addresses: int = 100_000,
    ) -> None:
        self.free_failures = free_failures
        self.backoff_s = backoff_s
        self.max_backoff_s = max(max_backoff_s, backoff_s)
        self.max_addresses = max_addresses
        self._records: dict[str, _Record] = {}
        self._peers: dict[str, _Record] = {}
        """The other processes' counts, summed per address, as of the last exchange."""
        self._changed: set[str] = set()
        """Addresses whose own count changed since it was last published."""

    def retry_after(self, address: str, now: float | None = None) -> float:
        """Seconds `address` is still locked out (0: not locked)."""
        record = self._records.get(address)
        peer = self._peers.get(address)
        if record is None and peer is None:
            return 0.0
        until = max(
            record.locked_until if record is not None else 0.0,
            peer.locked_until if peer is not None else 0.0,
        )
        return max(0.0, until - (time.monotonic() if now is None else now))

    def failed(self, address: str, now: float | None = None) -> float:
        """Count one failure of `address`; the lock-out it now has (0: none yet). The
        free failures and the doubling count every process's failures known here."""
        now = time.monotonic() if now is None else now
        record = self._live(self._records.get(address), now)
        if record is None:
            if len(self._records) >= self.max_addresses:
                self._prune(now)
            record = self._records[address] = _Record()
        record.failures += 1
        record.last_failure = now
        self._changed.add(address)
        peer = self._live(self._peers.get(address), now)
        lock = self._lock(record.failures + (peer.failures if peer is not None else 0))
        if lock:
            record.locked_until = max(record.locked_until, now + lock)
        return lock

    def outgoing(self, offset: float | None = None) -> dict[str, AuthFailures]:
        """This process's counts that changed since the last call, in wall-clock time
        (`offset`: `time.time() - time.monotonic()`); `unpublished` puts them back if
        they could not be published."""
        offset = time.time() - time.monotonic() if offset is None else offset
        out = {
            address: AuthFailures(
                r.failures,
                r.last_failure + offset,
                r.locked_until + offset if r.locked_until else 0.0,
            )
            for address in self._changed
            if (r := self._records.get(address)) is not None
        }
        self._changed.clear()
        return out

    def unpublished(self, addresses: Collection[str]) -> None:
        """Publish these addresses' counts with the next exchange (this one failed)."""
        self._changed.update(addresses)

    def apply_peers(self, peers: Mapping[str, AuthFailures], offset: float | None = None) -> None:
        """Take the other processes' counts (wall clock; replacing the last ones). An
        address whose failures summed with this process's pass the free ones is locked
        out from its latest failure, as if every failure had been counted here."""
        offset = time.time() - time.monotonic() if offset is None else offset
        now = time.monotonic()
        merged: dict[str, _Record] = {}
        for address, theirs in peers.items():
            peer = _Record(
                theirs.failures,
                theirs.locked_until - offset if theirs.locked_until else 0.0,
                theirs.last_failure - offset,
            )
            own = self._live(self._records.get(address), now)
            lock = self._lock(peer.failures + (own.failures if own is not None else 0))
            if lock:
                latest = max(peer.last_failure, own.last_failure if own is not None else 0.0)
                peer.locked_until = max(peer.locked_until, latest + lock)
            merged[address] = peer
        self._peers = merged

    def _lock(self, failures: int) -> float:
        """The lock-out after `failures` (0 within the free ones)."""
        over = failures - self.free_failures
        if over <= 0:
            return 0.0
        return min(self.backoff_s * 2.0 ** min(over - 1, 62), self.max_backoff_s)

    def _live(self, record: _Record | None, now: float) -> _Record | None:
        """`record`, or None once it was quiet long enough to start over."""
        if (
            record is not None
            and now - max(record.last_failure, record.locked_until) > self.max_backoff_s
        ):
            return None
        return record

    def _prune(self, now: float) -> None:
        """Forget quiet addresses; if none are, the oldest half (bounded memory)."""
        self._records = {a: r for a, r in self._records.items() if self._live(r, now) is not None}
        if len(self._records) >= self.max_addresses:
            by_age = sorted(self._records.items(), key=lambda item: item[1].last_failure)
            self._records = dict(by_age[len(by_age) // 2 :])


class FailuresExchange(Protocol):
    """The store's side of `sync_auth_failures` (`store.coordination`)."""

    def exchange_auth_failures(
        self, holder: str, mine: Mapping[str, AuthFailures], quiet_s: float, limit: int
    ) -> dict[str, AuthFailures]: ...


async def sync_auth_failures(
    throttle: AuthThrottle, store: FailuresExchange, holder: str, interval_s: float
) -> None:
    """Every `interval_s`, forever: publish this process's changed counts and take the
    other processes' (a read only, while nothing failed here). A failed exchange is
    logged; its counts go out with the next one, the last known peers' stay in force."""
    while True:
        await asyncio.sleep(interval_s)
        mine = throttle.outgoing()
        try:
            peers = await asyncio.to_thread(
                store.exchange_auth_failures,
                holder,
                mine,
                throttle.max_backoff_s,
                throttle.max_addresses,
            )
        except Exception:  # the database may be briefly unavailable
            throttle.unpublished(mine)
            log.warning("sharing auth-failure counts failed", exc_info=True)
            continue
        throttle.apply_peers(peers)


_TOKEN = "areal.token"
"""Scope key of the request's credential, read once (the throttle and the hot routes
both need it)."""
AUTH_FAILED = "areal.auth_failed"
"""Scope key of the callback that counts a 401, set for the paths whose app reports its
own (`AuthThrottleMiddleware` `self_reporting`)."""


def client_address(scope: Scope) -> str:
    """The address a request is counted under: the TCP peer, which uvicorn's proxy
    middleware has already replaced by `x-forwarded-for` for a trusted proxy."""
    return str((scope.get("client") or ("unknown", 0))[0])


def request_token(scope: Scope) -> str | None:
    """The credential a request carries (as `gateway.auth.bearer_token` reads it): one
    pass over the headers (the first of each name counts), remembered in the scope."""
    try:
        return scope[_TOKEN]  # type: ignore[no-any-return]
    except KeyError:
        pass
    authorization = api_key = None
    for key, value in scope.get("headers", ()):
        if key == b"authorization":
            if authorization is None:
                authorization = value.decode("latin-1")
        elif key == b"x-api-key" and api_key is None:
            api_key = value.decode("latin-1")
    token = scope[_TOKEN] = token_of(authorization, api_key)
    return token


def note_auth_failure(scope: Scope) -> None:
    """Count the 401 an app answered on a `self_reporting` path (nothing elsewhere: the
    throttle sees those 401s in `send`)."""
    failed = scope.get(AUTH_FAILED)
    if failed is not None:
        failed()


def too_many_failures(retry_after_s: float) -> OpenAIError:
    """The 429 a locked-out address gets (the key limits' 429; sent from below FastAPI
    with `OpenAIError.response`)."""
    seconds = max(1, math.ceil(retry_after_s))
    return rate_limited(
        f"too many failed sign-ins or unknown API keys from this address; retry in {seconds} s",
        retry_after_s,
        "too_many_auth_failures",
    )


class AuthThrottleMiddleware:
    """Pure ASGI: refuses locked-out addresses' guesses, counts failed ones.

    `throttle_of(scope)` and `known_good_of(scope)` find the app's throttle and its
    token check (None: not started yet, nothing is throttled). On `self_reporting`
    paths (the hot routes) the app counts its own 401s (`note_auth_failure`) and gets
    the server's `send` unwrapped: a wrapper there costs every streamed chunk a call."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        throttle_of: Callable[[Scope], AuthThrottle | None],
        known_good_of: Callable[[Scope], KnownGood | None],
        self_reporting: Collection[str] = (),
    ) -> None:
        self.app = app
        self._throttle_of = throttle_of
        self._known_good_of = known_good_of
        self._self_reporting = frozenset(self_reporting)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        throttle = self._throttle_of(scope) if scope["type"] == "http" else None
        if throttle is None:
            await self.app(scope, receive, send)
            return
        address = client_address(scope)
        token = request_token(scope)
        is_login = scope["path"] == LOGIN_PATH and scope["method"] == "POST"
        if not (token or is_login):  # nothing guessed: never refused, never counted
            await self.app(scope, receive, send)
            return
        wait = throttle.retry_after(address)
        if wait > 0:
            known_good = self._known_good_of(scope)
            if is_login or token is None or known_good is None or not known_good(token):
                # Checked, not refused: a right key (the admin's at sign-in, a key this
                # process has not seen yet) is served; a wrong one gets the 429.
                await self.app(scope, receive, _refusing_401(send, scope, receive, wait))
                return

        if scope["path"] in self._self_reporting:
            scope[AUTH_FAILED] = lambda: throttle.failed(address)
            await self.app(scope, receive, send)
            return

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] == 401:
                throttle.failed(address)
            await send(message)

        await self.app(scope, receive, counting_send)


def _refusing_401(send: Send, scope: Scope, receive: Receive, wait: float) -> Send:
    """`send` for a request from a locked-out address: its 401 (a wrong key, a failed
    sign-in) goes out as the lock-out's 429 instead (not counted again: the address is
    already locked out); any other reply unchanged."""
    replaced = False

    async def refusing_send(message: Message) -> None:
        nonlocal replaced
        if message["type"] == "http.response.start" and message["status"] == 401:
            replaced = True
            await too_many_failures(wait).response()(scope, receive, send)
            return
        if not replaced:
            await send(message)

    return refusing_send
