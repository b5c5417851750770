"""Liveness, readiness (store reachable and a backend healthy) and Prometheus metrics."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel

from gateway.deps import StateDep

router = APIRouter()


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


@router.get("/health/liveness")
@router.get("/health/liveliness", include_in_schema=False)
async def liveness() -> Liveness:
    """The process serves HTTP."""
    return Liveness()


@router.get("/health/readiness", response_model=Readiness,
            responses={503: {"model": Readiness}})
async def readiness(state: StateDep) -> Response:
    """200 when the store answers and at least one backend is healthy, else 503."""
    db = "ok"
    try:
        await asyncio.to_thread(state.store.ping)
    except Exception as exc:  # reported, not raised: this endpoint answers either way
        db = f"error: {type(exc).__name__}"
    backends = [{"url": s.url, "healthy": s.healthy, "in_flight": s.in_flight}
                for s in state.backends.status()]
    ready = db == "ok" and any(b["healthy"] for b in backends)
    body = {"status": "ready" if ready else "unavailable", "db": db, "backends": backends}


    return Response(json.dumps(body), status_code=200 if ready else 503,
                    media_type="application/json")


@router.get("/metrics")
async def metrics(state: StateDep) -> Response:
    """Prometheus text format."""
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
