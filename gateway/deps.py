"""FastAPI dependencies: the app's state and the authenticated caller, as Annotated aliases.
The hot routes read none of these: `gateway/ingress.py` hands them their request."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Query, Request

from gateway.auth import Principal, bearer_token, require_admin
from gateway.state import GatewayState

MAX_OFFSET = 1_000_000_000
"""Largest paging offset a list route takes (400 beyond): the databases' integers are
64-bit, and no list holds a billion rows to skip."""
PageOffset = Annotated[int, Query(ge=0, le=MAX_OFFSET)]
PageLimit = Annotated[int, Query(ge=0, le=MAX_OFFSET)]
"""A page size (the routes then serve at most 1000)."""


async def get_state(request: Request) -> GatewayState:
    """The `GatewayState` built by `create_app`'s lifespan. Async on purpose: FastAPI
    runs a sync dependency in its thread pool (a thread hop per request, ~0.3 ms)."""
    state: GatewayState = request.app.state.gateway
    return state


StateDep = Annotated[GatewayState, Depends(get_state)]


async def get_principal(request: Request, state: StateDep) -> Principal:
    """The caller (401 `invalid_api_key` unless the bearer token is known)."""
    return await state.keys.resolve(bearer_token(request))


PrincipalDep = Annotated[Principal, Depends(get_principal)]


async def get_admin(principal: PrincipalDep) -> Principal:
    """The caller, who must hold the admin key (403 otherwise)."""
    require_admin(principal)
    return principal


AdminDep = Annotated[Principal, Depends(get_admin)]
