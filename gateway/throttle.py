"""Throttling of credential guessing per client address (console logins, bearer tokens).

`AuthThrottle` counts failures per address: after `free_failures`, the address is
locked out for `backoff_s`, doubling with each further failure up to `max_backoff_s`; a
record with no failure for `max_backoff_s` past its lock-out is forgotten.
`AuthThrottleMiddleware` (outermost ASGI layer) applies it to every route, hot ones
included, at the cost of one dict lookup per request:

- a failure is a 401 answered to a request that carried a token (`authorization` or
  `x-api-key`), or a 401 from `POST /console/login` (a wrong admin key);
- while an address is locked out, its console login posts and its requests carrying a
  token that is not already known good (the admin key, or a key the resolver holds
  cached as valid) get 429 in the OpenAI shape with `retry-after`, without a store
  lookup. Agents on the same host with working keys keep working while one
  misconfigured (or hostile) client there is locked out.

The address is the TCP peer (`scope["client"]`): `x-forwarded-for` is not trusted. In
memory, per process; with several gateway processes each throttles on its own.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

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


@dataclass(slots=True)
class _Record:
    failures: int = 0
    locked_until: float = 0.0
    last_failure: float = 0.0


class AuthThrottle:
    """Failure counts and lock-outs per client address (bounded: `max_addresses`)."""

    def __init__(self, *, free_failures: int = 5, backoff_s: float = 1.0,
                 max_backoff_s: float = 300.0, max_addresses: int = 100_000) -> None:
        self.free_failures = free_failures
        self.backoff_s = backoff_s
        self.max_backoff_s = max(max_backoff_s, backoff_s)
        self._max_addresses = max_addresses
        self._records: dict[str, _Record] = {}

    def retry_after(self, address: str, now: float | None = None) -> float:
        """Seconds `address` is still locked out (0: not locked)."""
        record = self._records.get(address)
        if record is None:
            return 0.0
        return max(0.0, record.locked_until - (time.monotonic() if now is None else now))

    def failed(self, address: str, now: float | None = None) -> float:
        """Count one failure of `address`; the lock-out it now has (0: none yet)."""
        now = time.monotonic() if now is None else now
        record = self._records.get(address)
        if record is not None and now - max(record.last_failure, record.locked_until) \
                > self.max_backoff_s:
            record = None  # quiet long enough: start over
        if record is None:
            if len(self._records) >= self._max_addresses:
                self._prune(now)
            record = self._records[address] = _Record()
        record.failures += 1
        record.last_failure = now
        over = record.failures - self.free_failures
        if over <= 0:
            return 0.0
        lock = min(self.backoff_s * 2 ** min(over - 1, 62), self.max_backoff_s)
        record.locked_until = max(record.locked_until, now + lock)
        return lock

    def _prune(self, now: float) -> None:
        """Forget quiet addresses; if none are, the oldest half (bounded memory)."""
        horizon = self.max_backoff_s
        self._records = {a: r for a, r in self._records.items()
                         if now - max(r.last_failure, r.locked_until) <= horizon}
        if len(self._records) >= self._max_addresses:
            by_age = sorted(self._records.items(), key=lambda item: item[1].last_failure)
            self._records = dict(by_age[len(by_age) // 2:])


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


def request_token(scope: Scope) -> str | None:
    """The credential a request carries (as `gateway.auth.bearer_token` reads it)."""
    return token_of(_header(scope, b"authorization"), _header(scope, b"x-api-key"))


def too_many_failures(retry_after_s: float) -> OpenAIError:
    """The 429 a locked-out address gets (the key limits' 429; sent from below FastAPI
    with `OpenAIError.response`)."""
    seconds = max(1, math.ceil(retry_after_s))
    return rate_limited("too many failed sign-ins or unknown API keys from this address; "
                        f"retry in {seconds} s", retry_after_s, "too_many_auth_failures")


class AuthThrottleMiddleware:
    """Pure ASGI: refuses locked-out addresses' guesses, counts failed ones.

    `throttle_of(scope)` and `known_good_of(scope)` find the app's throttle and its
    token check (None: not started yet, nothing is throttled)."""

    def __init__(self, app: ASGIApp, *,
                 throttle_of: Callable[[Scope], AuthThrottle | None],
                 known_good_of: Callable[[Scope], KnownGood | None]) -> None:
        self.app = app
        self._throttle_of = throttle_of
        self._known_good_of = known_good_of

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        throttle = self._throttle_of(scope) if scope["type"] == "http" else None
        if throttle is None:
            await self.app(scope, receive, send)
            return
        address = (scope.get("client") or ("unknown", 0))[0]
        token = request_token(scope)
        is_login = scope["path"] == LOGIN_PATH and scope["method"] == "POST"
        if not (token or is_login):  # nothing guessed: never refused, never counted
            await self.app(scope, receive, send)
            return
        wait = throttle.retry_after(address)
        if wait > 0:
            known_good = self._known_good_of(scope)
            if is_login or token is None or known_good is None or not known_good(token):
                await too_many_failures(wait).response()(scope, receive, send)
                return

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] == 401:
                throttle.failed(address)
            await send(message)

        await self.app(scope, receive, counting_send)
