"""The backend pools of the policies with their own full weights (`policies[].weights:
full`): one `BackendPool` per such policy, over its own engines
(the serving plan's `PolicyPlan.backend_urls`), built and closed with the app.

Why separate pools: a full-weight policy's weights differ from every other policy's in
every tensor, so no engine can serve it beside the shared base. Its requests go to its
pool (the request path looks the pool up in `GatewayState.policy_pools`, one dict
lookup), its versions (`weights/<policy>/v{N}/`) are swapped onto that pool only, with
the pause and abort on that pool only, and a backend of that pool coming back is
re-synced to the policy's live version (the pool's `target`, as the main pool's is the
default policy's). LoRA policies and the default policy keep the main pool.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from areal_service.config import ServiceConfig
from areal_service.serving_plan import ServingPlan
from gateway.routing import BackendPool
from gateway.state import GatewayState
from gateway.swap_record import record_swap
from gateway.swap_verify import refused, swap_verified

log = logging.getLogger(__name__)


@dataclass
class Pools:
    """Every backend pool of the gateway: the main one (the default policy's and the
    LoRA policies') and one per full-weight policy."""

    main: BackendPool
    policies: dict[str, BackendPool]

    async def start(self) -> None:
        """Start every pool's health checks."""
        for pool in (self.main, *self.policies.values()):
            await pool.start()

    async def aclose(self) -> None:
        """Stop every pool's health checks and close its clients."""
        await self.main.aclose()
        await close_policy_pools(self.policies)


def build_pools(config: ServiceConfig, may_swap: Callable[[], bool]) -> Pools:
    """The pools `config` asks for, not started (`Pools.start`). `may_swap`: whether
    this process may re-sync a returning backend itself (the swap leader)."""
    main = BackendPool.from_config(config)  # the backends, or a router's workers
    main.may_swap = may_swap
    return Pools(main, build_policy_pools(config, may_swap))


def build_policy_pools(
    config: ServiceConfig, may_swap: Callable[[], bool] | None = None
) -> dict[str, BackendPool]:
    """A pool per full-weight policy, with the main pool's routing settings; not started.
    `may_swap`: as in `build_pools`."""
    pools = {
        name: BackendPool.from_config(config, name)
        for name in (p.name for p in ServingPlan(config).full_weight())
    }
    if may_swap is not None:
        for pool in pools.values():
            pool.may_swap = may_swap
    return pools


async def close_policy_pools(pools: dict[str, BackendPool]) -> None:
    """Stop every pool's health checks and close its clients."""
    for pool in pools.values():
        await pool.aclose()


async def sync_full_policies_once(state: GatewayState) -> list[tuple[str, int]]:
    """Swap each full-weight policy whose newest published version is newer than its live
    one onto that policy's pool (pause → load the full checkpoint → continue, on that
    pool's backends only); the other pools, adapters and versions are untouched. Returns
    the (policy, version) pairs swapped. One store read per full-weight policy per poll."""
    swapped = []
    for name, pool in state.policy_pools.items():
        latest = await asyncio.to_thread(state.store.latest_weight_version, name)
        if latest is None or latest.version <= state.policy_versions.get(name, 0):
            continue
        if refused(latest):
            continue
        t0 = time.perf_counter()
        # lora_name None: the engine's own (full) weights; sets pool.target for re-syncs.
        timings = await swap_verified(state, pool, latest)
        if timings is None:  # refused: this pool stays on its verified version
            continue
        state.policy_versions[name] = latest.version
        await record_swap(state.metrics, state.store, latest, timings, t0)
        swapped.append((name, latest.version))
    return swapped


async def follow_full_policies(state: GatewayState) -> None:
    """A follower's round: adopt each full-weight policy's live version, so its pool
    re-syncs a returning backend to it once the leader has."""
    for name, pool in state.policy_pools.items():
        live = await asyncio.to_thread(
            state.store.live_weight_version, policy=name, after=state.policy_versions.get(name, 0)
        )
        if live is not None:
            state.policy_versions[name] = live.version
            pool.target = (live.path, live.version)
