"""`KeyStore`: the virtual API keys' rows (`api_keys`): insert, look up by id or hash,
list, revoke, limits, usage, the session a key is bound to. Generating and hashing a key
is `areal_service/keys.py`'s; the per-process counters that enforce a key's limits
across gateway processes are `Coordination`'s (`coordination.py`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from sqlalchemy import bindparam, func, or_, select, update

from areal_service.store.access import RowAccess
from areal_service.store.rows import paged, row_values
from areal_service.store.schema import ApiKeyRow
from areal_service.types import ApiKeyRecord, now

LIMITS = frozenset({"rpm_limit", "tpm_limit", "max_concurrent", "token_budget"})
"""The columns `set_api_key_limits` may set."""


class KeyStore(RowAccess):
    """API keys, revoked ones included (`revoked_at` says so); only hashes are stored."""

    def add_api_key(self, record: ApiKeyRecord) -> ApiKeyRecord:
        """Insert a key (IntegrityError when the id or hash exists)."""
        self._add(ApiKeyRow(**row_values(record)))
        return record

    def get_api_key(self, key_id: str) -> ApiKeyRecord | None:
        """The key with id `key_id`, revoked or not."""
        return self._get(ApiKeyRecord, ApiKeyRow, key_id)

    def find_api_key_by_hash(self, key_hash: str) -> ApiKeyRecord | None:
        """The key whose SHA-256 hex is `key_hash` (revoked keys too: check `revoked_at`)."""
        found = self._list(ApiKeyRecord, select(ApiKeyRow).where(ApiKeyRow.key_hash == key_hash))
        return found[0] if found else None

    def find_api_keys_by_hashes(self, key_hashes: Collection[str]) -> dict[str, ApiKeyRecord]:
        """The keys whose hashes are among `key_hashes` (hash -> key; an unknown hash is
        absent). One indexed query for all of them: the gateway's key cache reloads
        every stale key it has in one store trip."""
        if not key_hashes:
            return {}
        found = self._list(
            ApiKeyRecord, select(ApiKeyRow).where(ApiKeyRow.key_hash.in_(list(key_hashes)))
        )
        return {record.key_hash: record for record in found}

    def list_api_keys(
        self,
        *,
        include_revoked: bool = True,
        limit: int = 100,
        offset: int = 0,
        kinds: Collection[str] | None = None,
    ) -> list[ApiKeyRecord]:
        """Keys, newest first; only those of `kinds` when given (the user's own keys
        are a handful among one session key per session ever started)."""
        statement = select(ApiKeyRow).order_by(ApiKeyRow.created_at.desc(), ApiKeyRow.id)
        if not include_revoked:
            statement = statement.where(ApiKeyRow.revoked_at.is_(None))
        if kinds is not None:
            statement = statement.where(ApiKeyRow.kind.in_(list(kinds)))
        return self._list(ApiKeyRecord, paged(statement, limit, offset))

    def count_api_keys(self, *, kinds: Collection[str] | None = None) -> int:
        """How many keys (of `kinds`, when given) exist, revoked ones included. A scan of
        the key table (no index on kind): for pages and commands, not per request."""
        statement = select(func.count()).select_from(ApiKeyRow)
        if kinds is not None:
            statement = statement.where(ApiKeyRow.kind.in_(list(kinds)))
        return self._count(statement)

    def revoke_api_key(self, key_id: str, *, at: float | None = None) -> ApiKeyRecord | None:
        """Revoke a key (a second revoke keeps the first time). None if unknown."""
        self._update(
            update(ApiKeyRow)
            .where(ApiKeyRow.id == key_id, ApiKeyRow.revoked_at.is_(None))
            .values(revoked_at=now() if at is None else at)
        )
        return self.get_api_key(key_id)

    def touch_api_keys(self, used_at: Mapping[str, float]) -> None:
        """Set `last_used_at` of many keys in one transaction (key id → time); a row
        keeps a later time another replica already wrote."""
        if not used_at:
            return
        statement = (
            update(ApiKeyRow)
            .where(
                ApiKeyRow.id == bindparam("key_id"),
                or_(ApiKeyRow.last_used_at.is_(None), ApiKeyRow.last_used_at < bindparam("at")),
            )
            .values(last_used_at=bindparam("at"))
        )
        with self._engine.begin() as connection:
            connection.execute(statement, [{"key_id": k, "at": t} for k, t in used_at.items()])

    def add_api_key_tokens(self, tokens: Mapping[str, int]) -> None:
        """Add to `tokens_used` of many keys in one transaction (key id → tokens)."""
        if not tokens:
            return
        statement = (
            update(ApiKeyRow)
            .where(ApiKeyRow.id == bindparam("key_id"))
            .values(tokens_used=ApiKeyRow.tokens_used + bindparam("n"))
        )
        with self._engine.begin() as connection:
            connection.execute(statement, [{"key_id": k, "n": n} for k, n in tokens.items()])

    def set_api_key_limits(
        self, key_id: str, limits: Mapping[str, int | None]
    ) -> ApiKeyRecord | None:
        """Set some of a key's limits (`LIMITS`; None: unlimited). The key, or None if
        unknown; ValueError for another name."""
        if set(limits) - LIMITS:
            raise ValueError(f"unknown limits {sorted(set(limits) - LIMITS)}")
        if limits:
            self._update(update(ApiKeyRow).where(ApiKeyRow.id == key_id).values(**limits))
        return self.get_api_key(key_id)

    def bind_key_session(self, key_id: str, session_id: str | None) -> None:
        """Point a key at its current session (None unbinds)."""
        self._update(update(ApiKeyRow).where(ApiKeyRow.id == key_id).values(session_id=session_id))
