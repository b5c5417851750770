"""Who is calling: bearer token → `Principal` (admin, or a virtual / session key).

Virtual keys are looked up by SHA-256 in the store, through a `RefreshingCache`
(`gateway/cache.py`): a store trip per request would dominate the gateway's own cost.
A revoke through this process takes effect at once, through another replica within
`ttl_s` plus one reload.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from areal_service.keys import admin_key_matches, hash_key
from areal_service.store import TrajectoryStore
from areal_service.types import ApiKeyRecord
from gateway.cache import RefreshingCache
from gateway.errors import OpenAIError, invalid_api_key


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
    header = request.headers.get("authorization")
    if header:
        scheme, _, token = header.partition(" ")
        return token.strip() if scheme.lower() == "bearer" and token.strip() else None
    return request.headers.get("x-api-key")


class KeyResolver:
    """Resolves tokens to principals through a `RefreshingCache` of store lookups."""

    def __init__(self, store: TrajectoryStore, admin_key: str, ttl_s: float = 5.0,
                 stale_s: float = 60.0) -> None:
        self._admin_key = admin_key
        self._keys: RefreshingCache[str, ApiKeyRecord] = RefreshingCache(
            store.find_api_key_by_hash, ttl_s=ttl_s, stale_s=stale_s)

    async def resolve(self, token: str | None) -> Principal:
        """The caller behind `token`; raises 401 `invalid_api_key` when unknown or revoked."""
        if not token:
            raise invalid_api_key(None)
        if admin_key_matches(token, self._admin_key):
            return Principal(is_admin=True)
        record = await self._keys.get(hash_key(token))
        if record is None or record.revoked_at is not None:
            raise invalid_api_key(token)
        return Principal(is_admin=False, key=record)

    def remember(self, record: ApiKeyRecord) -> None:
        """Cache a key this process just created (its first request needs no lookup)."""
        self._keys.put(record.key_hash, record)

    def forget(self, key_hash: str | None = None) -> None:
        """Drop cached lookups (one key, or all) after a revoke or rebind."""
        self._keys.forget(key_hash)


def require_admin(principal: Principal) -> None:
    """403 unless the caller used the admin key."""
    if not principal.is_admin:
        raise OpenAIError(403, "this endpoint needs the admin key", type="permission_error",
                          code="admin_required")
