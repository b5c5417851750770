"""The gateway's leader lease (`gateway/leader.py`) over a real store: one leader among
processes; a leader killed outright on this host is replaced at once, one elsewhere (or
alive) only after its lease expires."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from areal_service.store import TrajectoryStore
from gateway.leader import LEADER_LEASE, Leadership, _pid_namespace, dead_here


def _dead_pid() -> int:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    return gone.pid


@pytest.mark.processes
def test_dead_here_only_for_a_gone_process_of_this_host_and_namespace() -> None:
    host, ns = socket.gethostname(), _pid_namespace()
    assert dead_here(f"{host}:{ns}:{_dead_pid()}:abcd")
    assert not dead_here(f"{host}:{ns}:{os.getpid()}:abcd")  # alive
    assert not dead_here(f"elsewhere:{ns}:{_dead_pid()}:abcd")  # another host
    assert not dead_here(f"{host}:other-ns:{_dead_pid()}:abcd")  # another container
    assert not dead_here("garbage")


@pytest.mark.processes
async def test_one_leader_and_takeover(store: TrajectoryStore) -> None:
    first, second = (Leadership(store, ttl_s=30) for _ in range(2))
    assert await first.renew() and first.is_leader
    assert not await second.renew() and not second.is_leader  # first is alive
    assert await first.renew()  # renewal by the holder
    # A leader on another host stops renewing: nobody takes over before its expiry.
    store.coordination.release_lease(LEADER_LEASE, first.holder)
    assert store.coordination.acquire_lease(LEADER_LEASE, "other-host:1:2:x", 30)
    assert not await second.renew()
    # A leader of this host killed outright: its lease is taken at once.
    store.coordination.release_lease(LEADER_LEASE, "other-host:1:2:x")
    ghost = f"{socket.gethostname()}:{_pid_namespace()}:{_dead_pid()}:dead"
    assert store.coordination.acquire_lease(LEADER_LEASE, ghost, 30)
    assert await second.renew() and second.is_leader
    assert store.coordination.lease_holder(LEADER_LEASE) == second.holder
    await second.release()
    assert store.coordination.lease_holder(LEADER_LEASE) is None


async def test_a_failed_renewal_keeps_the_lease_until_its_expiry(
    store: TrajectoryStore, monkeypatch
) -> None:  # noqa: ANN001
    """The database down for a moment: a leader keeps leading until the expiry everyone
    else sees (nobody can take the row before it); a follower does not become leader."""
    leader, follower = Leadership(store, ttl_s=30), Leadership(store, ttl_s=30)
    assert await leader.renew()

    def down(*_: object) -> bool:
        raise OSError("database is down")

    monkeypatch.setattr(store.coordination, "acquire_lease", down)
    assert await leader.renew() and leader.is_leader
    assert not await follower.renew() and not follower.is_leader
    leader._held_until = 0.0  # its last known expiry passed
    assert not await leader.renew() and not leader.is_leader
