"""What is recorded once a weight version went live on its backends, the same for every
policy and every kind of swap: the swap metric, the version row's timings, a log line.
Shared by `gateway/weight_sync.py` and `gateway/policy_pools.py`."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Mapping

from areal_service.store import TrajectoryStore
from areal_service.types import WeightVersionRecord
from gateway.backends import SwapTimings
from gateway.metrics import GatewayMetrics

log = logging.getLogger(__name__)


async def record_swap(
    metrics: GatewayMetrics,
    store: TrajectoryStore,
    record: WeightVersionRecord,
    timings: Mapping[str, SwapTimings],
    t0: float,
    mode: str = "disk",
) -> None:
    """After `record`'s version went live (the swap began at `perf_counter` `t0`): its
    per-backend phase timings in `areal_policy_swap_seconds` and on its row (`swap`,
    `swap_s`, `swap_mode`, `live_at`, `publish_to_live_s`), and one log line. The same
    for every policy and every kind of swap (full, adapter, a full-weight policy's
    pool)."""
    swapped_at = time.time()
    swap = {url: dataclasses.asdict(t) for url, t in timings.items()}
    swap_s = time.perf_counter() - t0
    metrics.observe_swap(record.policy, swap, swap_s)
    await asyncio.to_thread(
        store.update_weight_version_metadata,
        record.version,
        {
            "swap": swap,
            "swap_s": swap_s,
            "swap_mode": mode,
            "live_at": swapped_at,
            "publish_to_live_s": swapped_at - record.created_at,
        },
        record.policy,
    )
    log.info(
        "policy %s: v%d live on %d backend(s) in %.3f s by %s (%.3f s after publish)",
        record.policy,
        record.version,
        len(timings),
        swap_s,
        mode,
        swapped_at - record.created_at,
    )
