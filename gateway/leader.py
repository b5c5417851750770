"""Leadership among gateway processes that share one store (workers on one port,
replicas on several hosts): the holder of the store's `gateway-leader` lease alone swaps
weights and sweeps idle sessions; the others follow the live version from the store.

Why a lease in the store and not a parent process: replicas on other hosts have no
common parent, and the store is the one thing they all share. Failover: a leader that
dies stops renewing, and another process takes the lease within `gateway.scale.leader_lease_s`
(plus one renewal interval); at once when the dead leader was a process of the same host
and pid namespace (a gateway restarted after kill -9 leads from its first request). A
leader that cannot renew (the database is down) steps down at its own expiry, so two
leaders never act at once while clocks agree.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid

from areal_service.store import TrajectoryStore

log = logging.getLogger(__name__)

LEADER_LEASE = "gateway-leader"


def _pid_namespace() -> str:
    """This process's pid namespace (Linux; "-" elsewhere): two containers may share a
    host name (host networking) but not a pid namespace."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "-"


def process_identity() -> str:
    """A holder name unique to this process: host, pid namespace, pid, and a random tail
    (a pid may be reused after a restart, while the old lease row is still there)."""
    return f"{socket.gethostname()}:{_pid_namespace()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def dead_here(holder: str) -> bool:
    """Whether `holder` names a process of this host and pid namespace that no longer
    exists (a worker or gateway killed outright): its lease can be taken at once instead
    of after its expiry. Anything else (another host, another namespace, an unreadable
    name, a live or unknown process) is not."""
    parts = holder.split(":")
    if len(parts) != 4 or parts[0] != socket.gethostname() or parts[1] != _pid_namespace():
        return False
    if parts[1] == "-" or not parts[2].isdigit():
        return False
    try:
        os.kill(int(parts[2]), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


class Leadership:
    """This process's view of the leader lease: `is_leader` is True only while a renewal
    succeeded less than one lease time ago."""

    def __init__(self, store: TrajectoryStore, *, ttl_s: float, holder: str | None = None) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self.holder = holder or process_identity()
        self._held_until = 0.0  # monotonic; the lease as this process last saw it

    @property
    def is_leader(self) -> bool:
        """Whether this process may do the leader's work now."""
        return time.monotonic() < self._held_until

    async def renew(self) -> bool:
        """Take or renew the lease once. On a database error nothing changes: a lease
        held stays held until its last known expiry (as everyone else sees it) and then
        lapses; one not held is not taken."""
        started = time.monotonic()
        try:
            held = await asyncio.to_thread(self._acquire)
        except Exception as e:  # noqa: BLE001 - any store failure
            log.warning("leader lease renewal failed: %s", e)
            return self.is_leader
        was = self.is_leader
        # Counted from before the call: the row's expiry is at least this late.
        self._held_until = started + self.ttl_s if held else 0.0
        if held and not was:
            log.info("this gateway process (%s) is now the leader", self.holder)
        elif was and not held:
            log.warning("this gateway process (%s) lost the leader lease", self.holder)
        return held

    def _acquire(self) -> bool:
        held = self.store.coordination.acquire_lease(LEADER_LEASE, self.holder, self.ttl_s)
        if not held:
            holder = self.store.coordination.lease_holder(LEADER_LEASE)
            if holder is not None and dead_here(holder):  # e.g. the last gateway, kill -9
                log.info("leader %s is gone; taking its lease now", holder)
                self.store.coordination.release_lease(LEADER_LEASE, holder)
                held = self.store.coordination.acquire_lease(LEADER_LEASE, self.holder, self.ttl_s)
        return held

    async def run(self) -> None:
        """Renew every third of the lease time, forever (cancelled at shutdown); the
        first renewal is the caller's, at start."""
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            await self.renew()

    async def release(self) -> None:
        """Give the lease up at a clean shutdown, so a successor need not wait it out."""
        if not self.is_leader:
            return
        self._held_until = 0.0
        try:
            await asyncio.to_thread(
                self.store.coordination.release_lease, LEADER_LEASE, self.holder
            )
        except Exception as e:  # noqa: BLE001 - it expires on its own
            log.warning("could not release the leader lease: %s", e)
