"""The weight syncer: watches the store for newly published `WeightVersion`s and swaps
every backend to them (pause → update_weights_from_disk → continue, always paired; see
`gateway/backend.py`), recording per-backend phase timings on the version's row.

Runs as a background task of the gateway (cancelled at shutdown). A failed swap is
logged and retried at the next poll; agents see only slower tokens, never errors,
because paused-and-aborted requests are resubmitted (interruptible generation).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from gateway.state import GatewayState

log = logging.getLogger(__name__)


async def sync_weights_once(state: GatewayState) -> int | None:
    """Swap to the latest published version if it is newer than the live one; returns the
    version swapped to (None when nothing was new)."""
    latest = await asyncio.to_thread(state.store.latest_weight_version)
    if latest is None or latest.version <= state.live_version:
        return None
    t0 = time.perf_counter()
    timings = await state.backends.swap_weights(latest.path, latest.version)
    swapped_at = time.time()
    state.live_version = latest.version
    swap = {url: dataclasses.asdict(t) for url, t in timings.items()}
    await asyncio.to_thread(state.store.update_weight_version_metadata, latest.version, {
        "swap": swap, "swap_s": time.perf_counter() - t0, "live_at": swapped_at,
        "publish_to_live_s": swapped_at - latest.created_at})
    log.info("weights v%d live on %d backend(s) in %.3f s (%.3f s after publish)",
             latest.version, len(timings), time.perf_counter() - t0,
             swapped_at - latest.created_at)
    return latest.version


async def run_weight_syncer(state: GatewayState) -> None:
    """Poll forever (until cancelled)."""
    while True:
        try:
            await sync_weights_once(state)
        except Exception:  # a backend or the store failed this round; retry next poll
            log.exception("weight swap failed; retrying")
        await asyncio.sleep(state.config.gateway.weight_poll_interval_s)
