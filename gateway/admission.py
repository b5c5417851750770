"""Staleness control at the door: new sessions are admitted only while

    started_sessions < (η + trained_version + 1) · batch_sessions

(AReaL's capacity rule, η = `trainer.max_staleness`, batch_sessions = `batch_groups ·
group_size`). Both counts come from the store, so a restarted gateway or trainer
continues the same window (AReaL#1388 grew the window past η after a resume).
η = 0 is fully synchronous: one batch in flight per version.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator

from gateway.errors import OpenAIError
from gateway.state import GatewayState


def window(state: GatewayState, trained_version: int) -> int:
    """How many sessions may have been started by now."""
    trainer = state.config.trainer
    return (trainer.max_staleness + trained_version + 1) * trainer.batch_groups * trainer.group_size


@contextlib.asynccontextmanager
async def admit_sessions(state: GatewayState, count: int) -> AsyncIterator[None]:
    """Admit `count` sessions for the body of the `async with` (which inserts them): wait
    up to `gateway.admit_wait_s` for room, then 429 with retry-after. Admitted-but-not-
    yet-inserted sessions are reserved so concurrent starts cannot overshoot the window;
    the lock is held only to check and reserve, never while waiting. A no-op when the
    gate is off."""
    gw = state.config.gateway
    if not gw.staleness_gate:
        yield
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + gw.admit_wait_s
    while True:
        async with state.admission_lock:
            started = await asyncio.to_thread(state.store.count_sessions)
            limit = window(state, state.live_version)
            if started + state.admission_reserved + count <= limit:
                state.admission_reserved += count
                break
        remaining = deadline - loop.time()
        if remaining <= 0:
            retry = math.ceil(max(gw.admit_wait_s, 1))
            raise OpenAIError(
                429, f"the staleness window is full ({started} sessions started, {limit} "
                f"allowed at trained version {state.live_version}); please try again in "
                f"{retry}s", type="requests", code="rate_limit_exceeded",
                headers={"retry-after": str(retry)})
        await asyncio.sleep(min(0.05, remaining))
    try:
        yield
    finally:
        state.admission_reserved -= count
