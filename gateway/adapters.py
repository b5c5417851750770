"""Versioned adapter names on one engine server (vLLM, SGLang): which served name each
policy's generations run under, how many requests run under each name, and when an old
version's name may be unloaded. Owned by one engine client (`Backend.adapters`),
used on its event loop only (no locks).

A swap of policy P to version N loads the adapter under a NEW name, `P@vN`, beside the
old one (never in place), then switches P's entry here: requests that start afterwards
run under `P@vN`, requests already running finish under the old name, and the old name
is unloaded once nothing runs under it. Nothing is paused or aborted, no other policy is
touched, and every request's tokens carry the version of the name it ran under. The
engines' own weight label (`/update_weight_version`, `meta_info.weight_version`) is one
per server, so the client tags a policy's tokens from here instead.

A retired name is unloaded when (a) no request of this client runs under it and `grace_s`
passed since it was retired, or (b) `max_wait_s` passed (a request that never ended must
not pin an adapter forever; the engine still finishes it, since vLLM's unload only drops
the name for new requests and SGLang waits for the adapter's running requests itself).
`grace_s` covers other gateway processes, which keep sending the old name until their
next poll of the store sees the new version.

A policy with no entry (never swapped on this server, e.g. created at runtime) runs on
the base model: its untrained version 0 is exactly the base (LoRA's B starts at zero).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

SEPARATOR = "@v"
"""Between the policy and the version in a served name. `@` is not allowed in policy
names (`POLICY_NAME_PATTERN`), so `P@vN` never equals another policy's name or
another policy's versioned name. vLLM and SGLang check no characters in adapter names;
`:` is avoided (SGLang reads `base:adapter` in a request's model name)."""


def served_name(policy: str, version: int) -> str:
    """The name version `version` of `policy`'s adapter is loaded under."""
    return f"{policy}{SEPARATOR}{version}"


@dataclass(frozen=True, slots=True)
class Lease:
    """One generation round's adapter: the served name it is sent under (None: the base
    model) and the version its tokens carry. Release it when the round ended."""

    served: str | None
    version: int


BASE = Lease(None, 0)
"""A policy with no adapter loaded yet: the base model, version 0."""


class AdapterNames:
    """The policy -> served-name map of one server, with in-flight counts per name and
    the retired names waiting to be unloaded (see the module docstring)."""

    def __init__(
        self, *, default_policy: str | None = None, grace_s: float = 5.0, max_wait_s: float = 600.0
    ) -> None:
        self.default_policy = default_policy
        """The policy of a request that names none (`lora_path` unset): SGLang serves the
        default policy's adapter through this map too; None (vLLM): such a request keeps
        the client's own default (`VLLMClient.lora_name`) and is not counted here."""
        self.grace_s = grace_s
        self.max_wait_s = max_wait_s
        self._current: dict[str, Lease] = {}
        self._running: dict[str, int] = {}
        self._retired: dict[str, float] = {}
        """Retired served name -> `time.monotonic()` when it was retired."""

    def current(self, policy: str) -> Lease:
        """What a request of `policy` would run under now (`BASE` before its first swap)."""
        return self._current.get(policy, BASE)

    def acquire(self, policy: str) -> Lease:
        """The lease a request of `policy` starts under (counted until `release`): one
        dict lookup and one count."""
        lease = self._current.get(policy, BASE)
        if lease.served is not None:
            self._running[lease.served] = self._running.get(lease.served, 0) + 1
        return lease

    def release(self, lease: Lease) -> None:
        """The request that acquired `lease` ended (any way)."""
        if lease.served is None:
            return
        left = self._running.get(lease.served, 0) - 1
        if left > 0:
            self._running[lease.served] = left
        else:
            self._running.pop(lease.served, None)

    def running(self, served: str) -> int:
        """Requests of this client running under `served` now."""
        return self._running.get(served, 0)

    def switch(self, policy: str, version: int) -> str | None:
        """Make `policy`'s new requests run under version `version` (already loaded on the
        server under `served_name(policy, version)`); returns the name it retires (None:
        none, or the same version again). An older version than the current one is
        refused (ValueError): the syncer only moves forward."""
        old = self._current.get(policy, BASE)
        if version == old.version and old.served is not None:
            return None
        if version < old.version:
            raise ValueError(f"policy {policy}: v{version} is older than the live v{old.version}")
        new = served_name(policy, version)
        self._current[policy] = Lease(new, version)
        self._retired.pop(new, None)  # loaded again after it was retired: live again
        if old.served is None:
            return None
        self._retired[old.served] = time.monotonic()
        return old.served

    def retire(self, policy: str) -> str | None:
        """`policy` was deleted: its live name is retired like a replaced version's (it
        is unloaded once its requests ended) and the policy is forgotten; the name
        retired (None: it had no adapter loaded)."""
        lease = self._current.pop(policy, None)
        if lease is None or lease.served is None:
            return None
        self._retired[lease.served] = time.monotonic()
        return lease.served

    def unloadable(self, served: str, now: float | None = None) -> bool:
        """Whether the retired `served` may be unloaded now: drained and past the grace,
        or past `max_wait_s`. False for a name that is not retired (live again)."""
        since = self._retired.get(served)
        if since is None:
            return False
        age = (time.monotonic() if now is None else now) - since
        return age >= self.max_wait_s or (age >= self.grace_s and not self._running.get(served))

    def retired(self) -> list[str]:
        """The retired names not unloaded yet."""
        return list(self._retired)

    def unloaded(self, served: str) -> None:
        """`served` is gone from the server (unloaded, or found missing)."""
        self._retired.pop(served, None)

    def forget(self) -> None:
        """The server lost its adapters (it restarted): every policy runs on the base until
        it is swapped again, and nothing is left to unload."""
        self._current.clear()
        self._retired.clear()
