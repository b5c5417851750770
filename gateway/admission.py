"""Staleness control at the door: a new session is admitted only while

    admitted_sessions < (η + trained_version + 1) · batch_sessions

(AReaL's capacity rule, η = `trainer.max_staleness`, batch_sessions = `batch_groups ·
group_size`, trained_version = the live weight version). `admitted_sessions` counts
what AReaL counts as accepted + running: every session that is not dropped (open,
ended, claimed, trained). A dropped session (stale, broken, unrewarded) gives its place
back, and each trained version widens the window by one batch, so the gate reopens as
the trainer advances. Both counts come from the store, so a restarted gateway or trainer
continues the same window (AReaL#1388 grew the window past η after a resume). η = 0 is
fully synchronous: one batch in flight per version. The window assumes a trained batch
holds batch_sessions sessions: groups larger than `trainer.group_size` use up more.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator

from gateway.errors import OpenAIError
from gateway.state import GatewayState


def window(state: GatewayState, trained_version: int) -> int:
    """How many admitted (not dropped) sessions the gate allows at `trained_version`."""
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
            admitted = await asyncio.to_thread(state.store.count_admitted_sessions)
            limit = window(state, state.live_version)
            if admitted + state.admission_reserved + count <= limit:
                state.admission_reserved += count
                break
        remaining = deadline - loop.time()
        if remaining <= 0:
            retry = math.ceil(max(gw.admit_wait_s, 1))
            raise OpenAIError(
                429, f"the staleness window is full ({admitted} sessions admitted, {limit} "
                f"allowed at trained version {state.live_version}); please try again in "
                f"{retry}s", type="requests", code="rate_limit_exceeded",
                headers={"retry-after": str(retry)})
        await asyncio.sleep(min(0.05, remaining))
    try:
        yield
    finally:
        state.admission_reserved -= count
