"""Staleness control at the door: new sessions are admitted only while

    started_sessions < (η + trained_version + 1) · batch_sessions

(AReaL's capacity rule, η = `trainer.max_staleness`, batch_sessions = `batch_groups ·
group_size`). Both counts come from the store, so a restarted gateway or trainer
continues the same window (AReaL#1388 grew the window past η after a resume).
η = 0 is fully synchronous: one batch in flight per version.
"""

from __future__ import annotations

import asyncio
import math

from gateway.errors import OpenAIError
from gateway.state import GatewayState


def window(state: GatewayState, trained_version: int) -> int:
    """How many sessions may have been started by now."""
    trainer = state.config.trainer
    return (trainer.max_staleness + trained_version + 1) * trainer.batch_groups * trainer.group_size


async def admit_sessions(state: GatewayState, count: int) -> None:
    """Return when `count` more sessions fit in the window; wait up to
    `gateway.admit_wait_s`, then 429 with retry-after. A no-op when the gate is off."""
    gw = state.config.gateway
    if not gw.staleness_gate:
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + gw.admit_wait_s
    async with state.admission_lock:  # one admission decision at a time per replica
        while True:
            started = await asyncio.to_thread(state.store.count_sessions)
            limit = window(state, state.live_version)
            if started + count <= limit:
                return
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise OpenAIError(
                    429, f"the staleness window is full ({started} sessions started, "
                    f"{limit} allowed at trained version {state.live_version}); please "
                    f"try again in {math.ceil(max(gw.admit_wait_s, 1))}s",
                    type="requests", code="rate_limit_exceeded",
                    headers={"retry-after": str(math.ceil(max(gw.admit_wait_s, 1)))})
            await asyncio.sleep(min(0.05, remaining))
