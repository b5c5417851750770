"""Liveness, readiness (store readable AND writable, a backend healthy) and Prometheus
metrics.

Readiness tells the truth about the write path: a SELECT answers while the database is
locked, read-only or full, and capture then fails every request with 503. So `db` is
decided by a probe write (`areal_service/store/write_probe.py`: a write that reaches the
disk and, after a failed capture, the room left on the disk and under the store's size
quota): on every call while the capture writer's last transaction failed, else at most every
`PROBE_INTERVAL_S`, so a fault no request has hit yet shows within that. One probe at a
time, waited for at most `PROBE_TIMEOUT_S`. A backend is reported down from its first
failed health check (one health interval), before routing takes it out."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Literal

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel

from gateway.deps import StateDep
from gateway.metrics import audit_exposition
from gateway.policy_figures import policy_exposition, policy_figures
from gateway.routing import BackendStatus
from gateway.state import GatewayState

router = APIRouter()

PROBE_TIMEOUT_S = 2.0
"""Longest readiness waits for a probe write (SQLite waits up to its busy timeout for
a lock; the probe goes on in its thread and the next readiness call joins it)."""

PROBE_INTERVAL_S = 5.0
"""How long a successful probe is trusted while the capture writer reports no error: a
fault that no request has hit yet is reported within this plus `PROBE_TIMEOUT_S`. One
probe is one page-sized write, so a load balancer polling every second costs one such
write per 5 s."""


class Liveness(BaseModel):
    status: Literal["alive"] = "alive"


class BackendHealth(BaseModel):
    url: str
    healthy: bool
    in_flight: int


class Readiness(BaseModel):
    """200 `ready`, or 503 `unavailable` with what is missing."""

    status: Literal["ready", "unavailable"]
    db: str
    """`ok` or `error: <exception>`."""
    backends: list[BackendHealth]
    policy_backends: dict[str, list[BackendHealth]] = {}
    """The own backends of each full-weight policy (`policies[].weights: full`); only
    reported: one policy's engines being down leaves the others served, so it does not
    make the gateway unavailable (that policy's requests get 503)."""
    tasks: dict[str, str] = {}
    """Background parts not running now (`gateway/supervisor.py`), by name: a task
    waiting to be started again after it ended, a store writer thread that died. Any
    makes the gateway unavailable."""


def _health(statuses: list[BackendStatus]) -> list[dict[str, object]]:
    return [
        {"url": s.url, "healthy": s.healthy and s.failed_checks == 0, "in_flight": s.in_flight}
        for s in statuses
    ]


@router.get("/health/liveness")
@router.get("/health/liveliness", include_in_schema=False)
async def liveness() -> Liveness:
    """The process serves HTTP."""
    return Liveness()


@router.get("/health/readiness", response_model=Readiness, responses={503: {"model": Readiness}})
async def readiness(request: Request, state: StateDep) -> Response:
    """200 when the store answers reads and writes, at least one backend is healthy and
    every background task runs, else 503 naming what failed."""
    db = await _db_status(request, state)
    backends = _health(state.backends.status())
    life = getattr(request.app.state, "life", None)
    tasks = {} if life is None else life.supervisor.problems()
    ready = db == "ok" and any(b["healthy"] for b in backends) and not tasks
    body: dict[str, object] = {
        "status": "ready" if ready else "unavailable",
        "db": db,
        "backends": backends,
    }
    if tasks:
        body["tasks"] = tasks
    if state.policy_pools:
        body["policy_backends"] = {
            name: _health(pool.status()) for name, pool in state.policy_pools.items()
        }
    return Response(
        json.dumps(body), status_code=200 if ready else 503, media_type="application/json"
    )


async def _db_status(request: Request, state: GatewayState) -> str:
    """`ok`, or `error: ...` when a read fails or the probe write does not succeed (a
    probe is run when the writer's last transaction failed, the last probe failed, or
    the last success is older than `PROBE_INTERVAL_S`)."""
    try:
        await asyncio.to_thread(state.store.ping)
    except Exception as exc:  # reported, not raised: this endpoint answers either way
        return f"error: {type(exc).__name__}"
    failed = state.writer.last_error
    app = request.app.state
    probe: asyncio.Future[None] | None = getattr(app, "write_probe", None)
    trusted = (
        probe is not None
        and probe.done()
        and not probe.cancelled()
        and probe.exception() is None
        and time.monotonic() - app.write_probe_at < PROBE_INTERVAL_S
    )
    if failed is None and trusted:
        return "ok"
    if probe is None or probe.done():  # stale: a new one
        probe = app.write_probe = asyncio.ensure_future(
            asyncio.to_thread(state.store.probe_write, check_room=failed is not None)
        )
        app.write_probe_at = time.monotonic()
        probe.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved
    try:
        await asyncio.wait_for(asyncio.shield(probe), PROBE_TIMEOUT_S)
    except TimeoutError:
        cause = f"{failed}; " if failed else ""
        return f"error: writes failing ({cause}probe write still waiting)"
    except Exception as exc:  # the probe's own failure is the answer
        return f"error: writes failing ({type(exc).__name__}: {str(exc).splitlines()[0]})"
    return "ok"


@router.get("/metrics")
async def metrics(state: StateDep) -> Response:
    """Prometheus text format. Needs the admin key as a bearer token unless
    `gateway.auth.public_metrics` is set (checked in `gateway/app.py`, with `/docs`)."""
    # In a thread: with several workers this reads every worker's metric files.
    text = await asyncio.to_thread(generate_latest, state.metrics.exposition())
    audit = await asyncio.to_thread(state.store.episode_audit, state.config.trainer)
    figures = await asyncio.to_thread(policy_figures, state)
    return Response(
        text + audit_exposition(audit) + policy_exposition(figures),
        media_type=CONTENT_TYPE_LATEST,
    )
