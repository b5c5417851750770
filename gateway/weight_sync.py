"""The weight syncer: watches the store for newly published `WeightVersion`s and swaps
every backend to them, recording per-backend phase timings on the version's row.

Two ways, chosen per version by the trainer (the row says which):

- disk: pause → update_weights_from_disk → continue, always paired (see
  `gateway/backends/base.py`); a policy's adapter (`policies:`, and the default policy's
  beside them) is one update with its `lora_name` and no pause, which touches only
  that policy's requests (`Backend.swap_adapter`);
- distributed (the row carries `metadata.sync`, a broadcast OFFER from the trainer's
  rank 0; protocol in `trainer/weight_broadcast.py`): pause every healthy backend →
  write `sync_world_size` on the row → `/init_weights_update_group` on every backend
  (rank offsets from each server's `/server_info` by SGLang's rule,
  `sglang_protocol.weight_group_layout`: `tp_size` ranks per server, also with dp
  attention; a dp > 1 server without it, or a pp > 1 one, cannot join, and the version
  is swapped from disk; the trainer joins as rank 0) → `/begin_weight_update` → per
  bucket `/update_weights_from_distributed` on every backend while the trainer
  broadcasts (the version with the last bucket) → `/end_weight_update` → continue,
  always sent. The group is kept for
  the next version while the trainer holds it and the healthy backends are the same
  (`SyncGroup`): then only the row write, pause, update and continue remain; otherwise
  the old group is destroyed after continue. The gateway stays the only process that talks to backends, and owns
  pause/continue and the live version on both paths.

An offer that expired, was refused or failed (`sync_error` from the trainer,
`sync_failed` from us) is swapped from disk: the trainer writes the `weights/v{N}`
copy after broadcasting, so a failed broadcast costs a retry, never the version.

Runs as a background task of the gateway (cancelled at shutdown). A failed swap is
logged and retried at the next poll; agents see only slower tokens, never errors,
because paused-and-aborted requests are resubmitted (interruptible generation).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from operator import methodcaller
from pathlib import Path
from typing import Any

from areal_service.sglang_protocol import (
    InitWeightsUpdateGroupRequest,
    UpdateWeightsFromDistributedRequest,
    weight_group_layout,
)
from areal_service.types import DEFAULT_POLICY, WeightVersionRecord
from gateway.backends import Backend, BackendError, BackendUnavailable, SwapTimings
from gateway.policy_pools import follow_full_policies, sync_full_policies_once
from gateway.routing import BackendPool, PoolMember
from gateway.state import GatewayState
from gateway.swap_record import record_swap
from gateway.swap_verify import canary_check, refused, settle, swap_fallback, swap_verified

log = logging.getLogger(__name__)

COPY_WAIT_MAX_S = 30.0
"""Longest a fallback waits for the trainer's disk copy to appear (a gateway that does
not share the trainer's filesystem tries the swap anyway; the backends read the path)."""


def distributed_offer(
    record: WeightVersionRecord, now: float | None = None
) -> Mapping[str, Any] | None:
    """The row's broadcast offer if it can still be taken, else None (swap from disk)."""
    offer = record.metadata.get("sync")
    if not isinstance(offer, Mapping) or offer.get("mode") != "distributed":
        return None
    if any(k in record.metadata for k in ("sync_error", "sync_failed", "sync_sent")):
        return None  # already taken, refused or failed
    if (now or time.time()) >= float(offer.get("expires_at", 0)):
        return None
    return offer


async def _each(
    backends: Sequence[PoolMember], call: Callable[[Backend], Awaitable[object]]
) -> None:
    """`call` on every backend concurrently; the first error is raised after all ended
    (one backend failing must not leave the others' calls unawaited)."""
    results = await asyncio.gather(*(call(b.client) for b in backends), return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r


async def _leave(backends: Sequence[PoolMember], group: str) -> None:
    """Destroy the group on every backend, after continue (off the swap's path); a
    failed group may already be gone there."""
    for b in backends:
        try:
            await b.client.destroy_weights_update_group(group)
        except BackendError as e:
            log.debug("destroy of %s on %s: %s", group, b.url, e)


@dataclass
class SyncGroup:
    """The weight-update group the backends are in between distributed swaps (owned by
    `run_weight_syncer`): reused while the trainer holds it and the healthy backends are
    the same ones."""

    name: str | None = None
    urls: tuple[str, ...] = ()
    world_size: int = 0

    def matches(self, offer: Mapping[str, Any], urls: tuple[str, ...]) -> bool:
        held = offer.get("held_group")
        return (
            self.name is not None
            and isinstance(held, Mapping)
            and held.get("name") == self.name
            and urls == self.urls
            and int(held.get("world_size", -1)) == self.world_size
        )


@dataclass(frozen=True, slots=True)
class _GroupPlan:
    """The weight-update group one distributed swap uses."""

    name: str
    world: int
    offsets: tuple[int, ...]
    """Each backend's first rank, when joining anew (empty when the group is reused)."""
    reuse: bool


async def _plan_group(
    held: SyncGroup, offer: Mapping[str, Any], healthy: Sequence[PoolMember]
) -> _GroupPlan:
    """Reuse `held` when the trainer holds it for the same backends, else the offer's
    new group, with rank offsets from each server's `/server_info`."""
    if held.matches(offer, tuple(b.url for b in healthy)):
        return _GroupPlan(str(held.name), held.world_size, (), True)
    infos = await asyncio.gather(*(b.client.server_info() for b in healthy))
    # ValueError for a server SGLang cannot join (dp > 1 without dp attention, pp > 1):
    # raised before the row names a world size, so the trainer gives up at once and
    # the version goes out from disk.
    world, offsets = weight_group_layout(infos)
    return _GroupPlan(str(offer["group_name"]), world, tuple(offsets), False)


async def _pause_and_join(
    state: GatewayState,
    record: WeightVersionRecord,
    offer: Mapping[str, Any],
    healthy: Sequence[PoolMember],
    plan: _GroupPlan,
) -> None:
    """Write the world size on the row, pause every backend and (unless the group is
    reused) join it. The trainer joins when it reads the row; joining touches no
    weights, so the three overlap. The first error is raised after all ended."""
    steps: list[Awaitable[object]] = [
        asyncio.to_thread(
            state.store.update_weight_version_metadata,
            record.version,
            {"sync_world_size": plan.world, "sync_group": plan.name},
        ),
        _each(healthy, lambda c: c.pause_generation("abort")),
    ]
    if not plan.reuse:
        join = InitWeightsUpdateGroupRequest(
            master_address=str(offer["master_address"]),
            master_port=int(offer["master_port"]),
            rank_offset=0,
            world_size=plan.world,
            group_name=plan.name,
            backend=str(offer.get("backend", "nccl")),
        )
        steps.append(
            asyncio.gather(
                *(
                    b.client.init_weights_update_group(join.model_copy(update={"rank_offset": off}))
                    for b, off in zip(healthy, plan.offsets, strict=True)
                )
            )
        )
    for r in await asyncio.gather(*steps, return_exceptions=True):
        if isinstance(r, BaseException):
            raise r


async def _receive_buckets(
    healthy: Sequence[PoolMember], offer: Mapping[str, Any], group: str, version: int
) -> None:
    """Every bucket the trainer broadcasts, on every backend (the version with the last),
    inside each backend's weight-update session (SGLang refuses the update outside one);
    the sessions are closed also when a bucket failed, or the next swap's begin would
    find one open."""
    await _each(healthy, methodcaller("begin_weight_update"))
    try:
        buckets = list(offer["buckets"])
        for i, bucket in enumerate(buckets):
            last = i == len(buckets) - 1
            body = UpdateWeightsFromDistributedRequest(
                names=bucket["names"],
                dtypes=bucket["dtypes"],
                shapes=bucket["shapes"],
                group_name=group,
                flush_cache=last,
                **({"weight_version": str(version)} if last else {}),
            )
            await _each(healthy, methodcaller("update_weights_from_distributed", body))
    except BaseException:
        await asyncio.gather(
            *(b.client.end_weight_update() for b in healthy), return_exceptions=True
        )
        raise
    await _each(healthy, methodcaller("end_weight_update"))


async def swap_distributed(
    state: GatewayState,
    record: WeightVersionRecord,
    offer: Mapping[str, Any],
    held: SyncGroup | None = None,
) -> dict[str, SwapTimings]:
    """Swap every healthy backend to `record` by the trainer's broadcast (see the module
    docstring), in the group `held` when it can be reused, else in the offer's new one
    (then `held` is updated and the old group left). Raises on any failure after
    sending continue to every backend (and `held` is cleared)."""
    held = held if held is not None else SyncGroup()
    pool: BackendPool = state.backends
    healthy = [b for b in pool.backends if b.healthy]
    if not healthy:
        raise BackendUnavailable("no healthy backend to sync")
    urls = tuple(b.url for b in healthy)
    plan = await _plan_group(held, offer, healthy)
    old = None if plan.reuse else held.name
    old_backends = [b for b in pool.backends if b.url in held.urls] if old else []
    held.name, held.urls, held.world_size = None, (), 0  # until this swap succeeded
    for b in healthy:
        b.swapping = True
    t0 = time.perf_counter()
    t1 = t2 = t3 = t0
    ok = False
    try:
        await _pause_and_join(state, record, offer, healthy, plan)
        t1 = time.perf_counter()
        await _receive_buckets(healthy, offer, plan.name, record.version)
        t2 = time.perf_counter()
        ok = True
    finally:
        try:
            await _each(healthy, lambda c: c.continue_generation())
        finally:
            for b in healthy:
                b.swapping = False
            t3 = time.perf_counter()
            if old:  # the backends' previous group (the trainer left it too)
                await _leave(old_backends, old)
            if ok:
                held.name, held.urls, held.world_size = plan.name, urls, plan.world
            else:  # also a half-joined group (best effort)
                await _leave(healthy, plan.name)
    pool.target = (record.path, record.version)  # a returning backend re-syncs from disk
    timing = SwapTimings(pause_s=t1 - t0, update_s=t2 - t1, continue_s=t3 - t2, total_s=t3 - t0)
    return {b.url: timing for b in healthy}


async def sync_weights_once(state: GatewayState, group: SyncGroup | None = None) -> int | None:
    """Swap to the latest published version if it is newer than the live one; returns the
    version swapped to (None when nothing was new). `group`: the weight-update group
    kept between distributed swaps (None: none is kept)."""
    latest = await asyncio.to_thread(state.store.latest_weight_version)
    if latest is None or latest.version <= state.live_version or refused(latest):
        return None
    t0 = time.perf_counter()
    mode = "disk"
    offer = distributed_offer(latest)
    timings: dict[str, SwapTimings] | None = None
    if offer is not None:
        check = canary_check(state, latest, None, swap_fallback(state, state.backends, None))
        try:
            timings = await swap_distributed(state, latest, offer, group)
            timings = await settle(state, state.backends, latest, timings, check)
            mode = "distributed"
        except Exception as e:  # noqa: BLE001 - any failure falls back to the disk copy
            log.warning(
                "distributed sync of v%d failed (%s); swapping from disk", latest.version, e
            )
            await asyncio.to_thread(
                state.store.update_weight_version_metadata,
                latest.version,
                {"sync_failed": f"{type(e).__name__}: {e}"},
            )
            await _wait_for_copy(latest, state.config.trainer.weight_sync_timeout_s)
    if mode == "disk":
        timings = await swap_verified(state, state.backends, latest, _default_adapter(state))
    if timings is None:  # refused by the canary: the verified version stays live
        return None
    state.live_version = latest.version
    await record_swap(state.metrics, state.store, latest, timings, t0, mode)
    return latest.version


def _default_adapter(state: GatewayState) -> str | None:
    """`DEFAULT_POLICY` when the default policy's versions are adapters swapped beside
    other policies' on the local engine: then its swap, too, touches only its own rows
    (no pause, `Backend.swap_adapter`). Otherwise None: the paired full swap."""
    if state.policy_registry.plan.default.swap == "adapter":
        return DEFAULT_POLICY
    return None


async def sync_policies_once(state: GatewayState) -> list[tuple[str, int]]:
    """Swap each declared policy's adapter (`policies:`) whose newest published version
    is newer than its live one, under the policy's name; only that adapter changes (the
    other policies keep theirs and their versions). On the local engine that is one
    paired pause/load/continue; on vLLM and SGLang a load under a versioned name with no
    pause (`Backend.swap_adapter`). Returns the (policy, version) pairs swapped.
    One store read per poll for all policies (the audit: one read per policy took the
    round from 0.1 to 0.8 s at 1,000 policies)."""
    swapped = []
    newest = await asyncio.to_thread(state.store.latest_weight_versions)
    for policy in state.policy_registry.declared:
        if policy.weights == "full":  # its own pool: `sync_full_policies_once`
            continue
        latest = newest.get(policy.name)
        if latest is None or latest.version <= state.policy_versions.get(policy.name, 0):
            continue
        if refused(latest):
            continue
        t0 = time.perf_counter()
        timings = await swap_verified(state, state.backends, latest, policy.name)
        if timings is None:  # refused: this policy's verified adapter stays
            continue
        state.policy_versions[policy.name] = latest.version
        await record_swap(state.metrics, state.store, latest, timings, t0)
        swapped.append((policy.name, latest.version))
    return swapped


async def follow_policies(state: GatewayState) -> None:
    """A follower's round for the declared policies (config and runtime): adopt each
    live adapter version (for its admission window and for re-syncing a returning
    backend). One store read per round while no policy published anything new; a policy
    with a newer version is then read on its own (its live one may lag its newest)."""
    newest = await asyncio.to_thread(state.store.latest_weight_versions)
    for policy in state.policy_registry.declared:
        if policy.weights == "full":  # `follow_full_policies`
            continue
        published = newest.get(policy.name)
        if published is None or published.version <= state.policy_versions.get(policy.name, 0):
            continue
        live = await asyncio.to_thread(
            state.store.live_weight_version,
            policy=policy.name,
            after=state.policy_versions.get(policy.name, 0),
        )
        if live is not None:
            state.policy_versions[policy.name] = live.version
            state.backends.adopt_adapter(policy.name, live.version)
            state.backends.adapter_targets[policy.name] = (live.path, live.version)


async def _wait_for_copy(record: WeightVersionRecord, timeout_s: float) -> None:
    """After a failed broadcast, give the trainer time to write the disk copy (it does
    so right after broadcasting) before the disk swap tries to read it."""
    deadline = time.monotonic() + min(timeout_s, COPY_WAIT_MAX_S)
    config = Path(record.path) / "config.json"
    while not await asyncio.to_thread(config.is_file) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)


async def follow_live_version(state: GatewayState) -> int | None:
    """A follower's round (another process holds the leader lease and swaps): adopt the
    version the leader made live, so admission and re-admitted backends use it; returns
    the version adopted (None when nothing changed)."""
    live = await asyncio.to_thread(state.store.live_weight_version, after=state.live_version)
    if live is None or live.version <= state.live_version:
        return None
    state.live_version = live.version
    state.backends.target = (live.path, live.version)
    state.backends.adopt_adapter(None, live.version)  # versioned default adapter, if any
    return live.version


def export_live_versions(state: GatewayState) -> None:
    """`areal_policy_version{policy}` from the live versions (every poll, leader or
    follower: a few dict reads and cached gauge children)."""
    state.metrics.set_policy_version(DEFAULT_POLICY, state.live_version)
    for policy in state.config.policies:
        state.metrics.set_policy_version(policy.name, state.policy_versions.get(policy.name, 0))


async def run_weight_syncer(state: GatewayState) -> None:
    """Poll forever (until cancelled): swap while this process leads, else follow."""
    group = SyncGroup()
    while True:
        started = time.perf_counter()
        before = (state.live_version, dict(state.policy_versions))
        try:
            if state.leadership.is_leader:
                await sync_weights_once(state, group)
                await sync_policies_once(state)
                await sync_full_policies_once(state)
            else:
                await follow_live_version(state)
                await follow_policies(state)
                await follow_full_policies(state)
        except Exception:  # a backend or the store failed this round; retry next poll
            log.exception("weight swap failed; retrying")
        export_live_versions(state)
        if (state.live_version, state.policy_versions) != before:
            state.notice_versions_moved()  # the staleness windows moved: wake their waiters
        state.metrics.sync_round.set(time.perf_counter() - started)
        await asyncio.sleep(state.config.gateway.router.weight_poll_interval_s)
