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

Every gateway process sharing the store (workers, replicas) checks the same window: the
check and the reservation of the places are one store transaction that the processes
take in turn (`areal_service/store/admissions.py`), so together they never admit past
it. A process that dies between reserving and inserting holds its places for at most
`ADMISSION_TTL_S`.

Per policy (`policies:` declared): each policy has its own window, counted over its own
sessions and reservations, at its own trained version (its live adapter version,
`state.policy_versions`, which its own trainer advances; the default policy's is
`live_version`). So a policy whose trainer lags or stopped fills only its own window,
and the 429 names the policy. Without declared policies there is the one window over
every session, exactly as before.

Per key: a user key's sessions take at most `gateway.sessions.key_window_share` of the
sessions a window lets be in flight, `(η + 1) · batch_sessions` (never less than one
batch: a key alone must be able to fill a batch), counted in the same store transaction
(`admissions.KeyShare`); past it the key's start waits like any, then 429 naming the key's
share. The admin's sessions (one session key each) count against no key.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
from collections.abc import AsyncIterator

from areal_service.store.admissions import KeyShare, KeyShareFull
from areal_service.types import DEFAULT_POLICY
from gateway.errors import OpenAIError
from gateway.state import GatewayState

log = logging.getLogger(__name__)


def window(state: GatewayState, trained_version: int) -> int:
    """How many admitted (not dropped) sessions the gate allows at `trained_version`."""
    trainer = state.config.trainer
    return (trainer.max_staleness + trained_version + 1) * trainer.batch_groups * trainer.group_size


def trained_version(state: GatewayState, policy: str = DEFAULT_POLICY) -> int:
    """The trained version `policy`'s window is at: its live version (a dict lookup)."""
    if policy == DEFAULT_POLICY:
        return state.live_version
    return state.policy_versions.get(policy, 0)


def key_share(state: GatewayState, key_id: str | None) -> KeyShare | None:
    """`key_id`'s part of a window (module docstring); None for no key or a share of 1."""
    share = state.config.gateway.sessions.key_window_share
    if key_id is None or share >= 1:
        return None
    trainer = state.config.trainer
    batch = trainer.batch_groups * trainer.group_size
    return KeyShare(key_id, max(batch, math.floor(share * (trainer.max_staleness + 1) * batch)))


ADMISSION_TTL_S = 60.0
"""How long a reservation holds its places if its process never releases it (the
inserts it covers take milliseconds; a group of 1024 sessions, about a second)."""

RECHECK_S = 0.5
"""A start waiting for room asks the store again this often, besides at once when this
process sees a live version change (`GatewayState.versions_moved`, the usual way a
window widens): for what no notice covers here (another process's unused places given
back, a reservation that lapsed, a dropped session). It used to ask every 50 ms: 8
waiting starts cost the demo's gateway half its CPU, beside the trainer's step."""


async def _wait_for_room(state: GatewayState, moved: asyncio.Event, timeout_s: float) -> None:
    """Until `moved` is set (a live version changed), the server begins to stop, or
    `timeout_s` passed."""
    waits = [asyncio.ensure_future(moved.wait()), asyncio.ensure_future(state.stopping.wait())]
    try:
        await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()


@contextlib.asynccontextmanager
async def admit_sessions(
    state: GatewayState, count: int, policy: str = DEFAULT_POLICY, key_id: str | None = None
) -> AsyncIterator[str | None]:
    """Admit `count` sessions of `policy` for the body of the `async with`, which inserts them with
    the reservation it is given (`TrajectoryStore.add_session(record, admission)`): wait
    up to `gateway.sessions.admit_wait_s` for room, then 429 with retry-after. The places are
    reserved in the store until the body ends, so concurrent starts in this process or
    any other cannot overshoot the window; nothing is held while waiting. The process's
    lock keeps its own starts to one store transaction at a time. `key_id`: the user key
    the sessions are for (its share of the window). A no-op (reservation None) when the
    gate is off."""
    gw = state.config.gateway
    if not gw.sessions.staleness_gate:
        yield None
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + gw.sessions.admit_wait_s
    while True:
        moved = state.versions_moved  # before the version is read: no change is missed
        if state.stopping.is_set():  # answered now, not cancelled at the shutdown timeout
            raise OpenAIError(
                503,
                "the gateway is shutting down; the session was not started (retry once "
                "a gateway is serving again)",
                type="server_error",
                code="shutting_down",
                headers={"retry-after": "5"},
            )
        version = trained_version(state, policy)
        limit = window(state, version)
        share = key_share(state, key_id)
        full: KeyShareFull | None = None
        taken = 0
        async with state.admission_lock:
            try:
                reservation, taken = await asyncio.to_thread(
                    functools.partial(
                        state.store.coordination.reserve_admission,
                        count,
                        limit,
                        ADMISSION_TTL_S,
                        policy=policy if state.policy_registry.declared else None,
                        key=share,
                    )
                )
            except KeyShareFull as refused:
                reservation, full = None, refused
        if reservation is not None:
            break
        remaining = deadline - loop.time()
        if remaining <= 0:
            raise _full(state, policy, full, taken, limit, version)
        await _wait_for_room(state, moved, min(RECHECK_S, remaining))
    try:
        yield reservation
    finally:
        try:  # runs to the end in its thread even if this task is cancelled meanwhile
            await asyncio.to_thread(state.store.coordination.release_admission, reservation)
        except Exception:  # noqa: BLE001 - the reservation lapses at its expiry
            log.warning(
                "staleness gate: reservation %s not released; it lapses in %.0f s",
                reservation,
                ADMISSION_TTL_S,
                exc_info=True,
            )


def _full(
    state: GatewayState,
    policy: str,
    key: KeyShareFull | None,
    taken: int,
    limit: int,
    version: int,
) -> OpenAIError:
    """The 429 of a full window, or of a key's full share of it."""
    retry = math.ceil(max(state.config.gateway.sessions.admit_wait_s, 1))
    if key is not None:
        what = (
            f"this key already holds {key.held} of its {key.limit} places in the staleness "
            f"window of policy {policy!r} (gateway.sessions.key_window_share); its sessions "
            "give them back once trained"
        )
    else:
        what = (
            f"the staleness window of policy {policy!r} is full ({taken} of its {limit} "
            f"places taken at trained version {version})"
        )
    return OpenAIError(
        429,
        f"{what}; please try again in {retry}s",
        type="requests",
        code="rate_limit_exceeded",
        headers={"retry-after": str(retry)},
    )
