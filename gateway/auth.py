"""Who is calling: bearer token → `Principal` (admin, or a virtual / session key).

Virtual keys are looked up by SHA-256 in the store, through a `RefreshingCache`
(`gateway/cache.py`): a store trip per request would dominate the gateway's own cost.
A revoke through this process takes effect at once, through another replica within
`ttl_s` plus one reload.

`last_used_at` is kept off the request path: `KeyUsage.note` is a dict store, and
`flush_key_usage` (a task of the app) writes what was noted in one transaction per
`gateway.auth.key_usage_interval_s`, so a key's row is written at most once per interval.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from fastapi import Request

from areal_service.keys import admin_key_matches, hash_key
from areal_service.store import TrajectoryStore
from areal_service.types import DEFAULT_POLICY, ApiKeyRecord
from gateway.cache import RefreshingCache
from gateway.errors import OpenAIError, invalid_api_key
from gateway.limits import KeyLimits

log = logging.getLogger(__name__)

MAX_KNOWN_GOOD = 100_000


@dataclass(frozen=True, slots=True)
class Principal:
    """The authenticated caller of one request."""

    is_admin: bool
    key: ApiKeyRecord | None = None

    @property
    def key_id(self) -> str | None:
        """Id of the virtual key, None for the admin."""
        return self.key.id if self.key else None


def bearer_token(request: Request) -> str | None:
    """The `Authorization: Bearer …` token (or `x-api-key`, as Anthropic-style clients send)."""
    return token_of(request.headers.get("authorization"), request.headers.get("x-api-key"))


def token_of(authorization: str | None, x_api_key: str | None) -> str | None:
    """The credential of these two header values: a bearer `authorization` wins (any
    other scheme is no token), else `x-api-key`. One rule for the routes and the ASGI
    throttle, which reads raw headers."""
    if authorization:
        scheme, _, token = authorization.partition(" ")
        return token.strip() if scheme.lower() == "bearer" and token.strip() else None
    return x_api_key


class KeyUsage:
    """Last use of each key since the previous flush (key id → unix time).

    Throttled at the source: a key noted less than `min_interval_s` ago is not noted
    again, so its stored time lags by at most that interval (plus one flush)."""

    def __init__(self, min_interval_s: float, max_keys: int = 100_000) -> None:
        self.min_interval_s = min_interval_s
        self._max_keys = max_keys
        self._pending: dict[str, float] = {}
        self._tokens: dict[str, int] = {}
        """Tokens used per key since the last flush (summed, never throttled)."""
        self._noted: dict[str, float] = {}
        """When each key was last noted (bounded: cleared past `max_keys`)."""

    def note(self, key_id: str, now: float | None = None) -> None:
        """Record a use of `key_id` (O(1), on the request path)."""
        now = time.time() if now is None else now
        if now - self._noted.get(key_id, float("-inf")) < self.min_interval_s:
            return
        if len(self._noted) >= self._max_keys:
            self._noted.clear()
        self._noted[key_id] = self._pending[key_id] = now

    def add_tokens(self, key_id: str, tokens: int) -> None:
        """Count `tokens` used by `key_id` (flushed into `tokens_used`)."""
        self._tokens[key_id] = self._tokens.get(key_id, 0) + tokens

    def unflushed_tokens(self) -> dict[str, int]:
        """Tokens counted per key and not yet taken by a flush (a copy)."""
        return dict(self._tokens)

    def take_tokens(self) -> dict[str, int]:
        """Tokens counted since the last `take_tokens` (and forget them)."""
        tokens, self._tokens = self._tokens, {}
        return tokens

    def take(self) -> dict[str, float]:
        """What was noted since the last `take` (and forget it)."""
        pending, self._pending = self._pending, {}
        return pending

    def restore(self, pending: dict[str, float]) -> None:
        """Put back what a failed flush took (newer notes win)."""
        for key_id, at in pending.items():
            self._pending.setdefault(key_id, at)


class KeyResolver:
    """Resolves tokens to principals through a `RefreshingCache` of store lookups."""

    def __init__(
        self,
        store: TrajectoryStore,
        admin_key: str,
        ttl_s: float = 5.0,
        stale_s: float = 60.0,
        usage_interval_s: float = 30.0,
    ) -> None:
        self._admin_key = admin_key
        self.usage = KeyUsage(usage_interval_s)
        self.limits = KeyLimits(on_tokens=self.usage.add_tokens)
        self._good: set[str] = set()
        """Hashes of keys that resolved here (the auth throttle's "known good", kept
        across the cache's `forget` on a session rebind)."""
        """Per-key rate, concurrency and budget limits (`gateway/limits.py`)."""
        self._keys: RefreshingCache[str, ApiKeyRecord] = RefreshingCache(
            store.keys.find_api_keys_by_hashes, ttl_s=ttl_s, stale_s=stale_s
        )
        self.check_policy: Callable[[str], Awaitable[None]] | None = None
        """Refuses a key whose policy was deleted (`gateway.policies.check_key_policy`,
        set once the policies are loaded); called for keys bound to a named policy."""

    async def resolve(self, token: str | None) -> Principal:
        """The caller behind `token`; raises 401 `invalid_api_key` when unknown or revoked."""
        if not token:
            raise invalid_api_key(None)
        if admin_key_matches(token, self._admin_key):
            return Principal(is_admin=True)
        key_hash = hash_key(token)
        record = await self._keys.get(key_hash)
        if record is None or record.revoked_at is not None:
            raise invalid_api_key(token)
        if key_hash not in self._good:
            if len(self._good) >= MAX_KNOWN_GOOD:
                self._good.clear()  # bounded; refilled by the next successful requests
            self._good.add(key_hash)
        self.usage.note(record.id)
        if self.check_policy is not None and record.policy != DEFAULT_POLICY:
            await self.check_policy(record.policy)
        return Principal(is_admin=False, key=record)

    def known_good(self, token: str) -> bool:
        """Whether `token` is the admin key, a key cached as valid or one that resolved
        here before (no store lookup: the auth throttle lets these through while their
        address is locked out)."""
        if admin_key_matches(token, self._admin_key):
            return True
        key_hash = hash_key(token)
        record = self._keys.peek(key_hash)
        if record is not None:
            return record.revoked_at is None
        return key_hash in self._good  # a revoked one then gets its 401 from `resolve`

    def remember(self, record: ApiKeyRecord) -> None:
        """Cache a key this process just created (its first request needs no lookup)."""
        self._keys.put(record.key_hash, record)

    def forget(self, key_hash: str | None = None) -> None:
        """Drop cached lookups (one key, or all) after a revoke or rebind."""
        self._keys.forget(key_hash)


async def flush_key_usage(usage: KeyUsage, store: TrajectoryStore, interval_s: float) -> None:
    """Write noted key uses every `interval_s`, forever (cancelled at shutdown, after
    which the caller flushes once more). A failed write is logged and its times are
    kept for the next round (a later use of the same key wins)."""
    while True:
        await asyncio.sleep(interval_s)
        write = asyncio.ensure_future(write_key_usage(usage, store))
        try:
            await asyncio.shield(write)
        except asyncio.CancelledError:
            # Shutdown mid-write: what this write took out of `usage` is only in its
            # thread, which cannot be stopped; let it commit before the store closes
            # (else the final flush finds nothing and the counts are lost).
            await write
            raise


async def write_key_usage(usage: KeyUsage, store: TrajectoryStore) -> None:
    """One flush of `usage` to the store (in a thread; nothing to do when empty)."""
    pending = usage.take()
    if pending:
        try:
            await asyncio.to_thread(store.keys.touch_api_keys, pending)
        except Exception:  # the database may be briefly unavailable; keep the times
            log.exception("writing last_used_at of %d keys failed", len(pending))
            usage.restore(pending)
    tokens = usage.take_tokens()
    if tokens:
        try:
            await asyncio.to_thread(store.keys.add_api_key_tokens, tokens)
        except Exception:  # kept for the next flush: counts add up
            log.exception("writing tokens_used of %d keys failed", len(tokens))
            for key_id, n in tokens.items():
                usage.add_tokens(key_id, n)


def require_admin(principal: Principal) -> None:
    """403 unless the caller used the admin key."""
    if not principal.is_admin:
        raise OpenAIError(
            403, "this endpoint needs the admin key", type="permission_error", code="admin_required"
        )
