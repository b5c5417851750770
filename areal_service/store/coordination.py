"""`Coordination`: what the gateway processes sharing one store (workers on one host,
replicas on several) agree on through it, none of which is a trajectory: named leases
(`leases.py`), staleness-window admissions (`admissions.py`), failed-credential counts
(`auth_failures.py`), per-key counts (`key_counters.py`) and signed-out console cookies
(`revocations.py`). Each of those modules holds its table's SQL and is called only from
here (and, for the admission a new session takes, from `TrajectoryStore.add_session`).

`now` parameters exist for tests that step a clock; callers leave them out.
"""

from __future__ import annotations

from collections.abc import Mapping

from sqlalchemy import Engine

from areal_service.store import admissions, auth_failures, key_counters, leases, revocations
from areal_service.types import AuthFailures, KeyCounts


class Coordination:
    """Cross-process coordination over the store's engine; every method is one short
    transaction (synchronous: async callers run it in a thread)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    # Leases (`leases.py`).

    def acquire_lease(
        self, name: str, holder: str, ttl_s: float, *, now: float | None = None
    ) -> bool:
        """Take or renew lease `name` for `holder`; True when it is held afterwards."""
        return leases.acquire_lease(self._engine, name, holder, ttl_s, now=now)

    def release_lease(self, name: str, holder: str) -> None:
        """Give lease `name` up if `holder` has it."""
        leases.release_lease(self._engine, name, holder)

    def lease_holder(self, name: str, *, now: float | None = None) -> str | None:
        """The current holder of lease `name` (None: free or expired)."""
        return leases.lease_holder(self._engine, name, now=now)

    # Staleness-window admissions (`admissions.py`).

    def reserve_admission(
        self,
        count: int,
        limit: int,
        ttl_s: float,
        *,
        now: float | None = None,
        policy: str | None = None,
        key: admissions.KeyShare | None = None,
    ) -> tuple[str | None, int]:
        """Hold `count` places in a window of `limit` (None: no room) and the places
        taken before; atomic across every process on the store. `policy`: that policy's
        own window (None: the single window of every session); `key`: a user key's share
        of it (`admissions.KeyShareFull` past it)."""
        return admissions.reserve_admission(
            self._engine, count, limit, ttl_s, now=now, policy=policy, key=key
        )

    def release_admission(self, reservation: str) -> None:
        """Give a reservation's places back."""
        admissions.release_admission(self._engine, reservation)

    # Signed-out console cookies (`revocations.py`).

    def revoke_console_session(
        self, nonce: str, expires_at: float, *, now: float | None = None
    ) -> None:
        """Refuse the console cookie with `nonce` on every process until `expires_at`."""
        revocations.revoke_console_session(self._engine, nonce, expires_at, now=now)

    def console_session_revoked(self, nonce: str) -> bool:
        """Whether the console cookie with `nonce` was signed out."""
        return revocations.console_session_revoked(self._engine, nonce)

    # Failed-credential counts shared by gateway processes (`auth_failures.py`).

    def exchange_auth_failures(
        self,
        holder: str,
        mine: Mapping[str, AuthFailures],
        quiet_s: float,
        limit: int,
        *,
        now: float | None = None,
    ) -> dict[str, AuthFailures]:
        """Publish `holder`'s changed counts; the other holders' live counts per address
        (at most `limit` addresses, the most recent first)."""
        return auth_failures.exchange_auth_failures(
            self._engine, holder, mine, quiet_s, limit=limit, now=now
        )

    # Per-key counts shared by gateway processes (`key_counters.py`).

    def exchange_key_counts(
        self,
        holder: str,
        counts: Mapping[str, KeyCounts],
        fresh_s: float,
        *,
        now: float | None = None,
    ) -> tuple[dict[str, KeyCounts], dict[str, int]]:
        """Publish `holder`'s counts; the other holders' fresh counts and the stored
        `tokens_used` of the same keys."""
        return key_counters.exchange_key_counts(self._engine, holder, counts, fresh_s, now=now)

    def forget_key_counts(self, holder: str) -> None:
        """Delete `holder`'s published counts (a clean shutdown)."""
        key_counters.forget_key_counts(self._engine, holder)
