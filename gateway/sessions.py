"""Which session (episode) a request belongs to, without client code changes.

Sources, in order: a session-scoped key; an `x-session-id` header; `metadata.session_id`
in the body. A named session must exist and belong to the caller's key (admin may name
any). No session at all is fine: the completion is recorded unattached. Also the access
rule of the session routes (`routes/rl.py`, `routes/rewards.py`).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from fastapi import Request

from areal_service.types import ApiKeyRecord, SessionRecord
from gateway.admission import admit_sessions
from gateway.auth import Principal
from gateway.errors import OpenAIError
from gateway.state import GatewayState


def requested_session_id(principal: Principal, request: Request, body: dict[str, Any]
                         ) -> str | None:
    """The session the request names (key binding first, then header, then metadata)."""
    if principal.key is not None and principal.key.kind == "session":
        return principal.key.session_id
    header = request.headers.get("x-session-id")
    if header:
        return header
    metadata = body.get("metadata")
    if isinstance(metadata, dict) and isinstance(metadata.get("session_id"), str):
        return str(metadata["session_id"])
    if principal.key is not None:
        return principal.key.session_id  # a user key's current session, if bound
    return None


async def session_for_request(state: GatewayState, principal: Principal, request: Request,
                              body: dict[str, Any]) -> str | None:
    """The open session this completion is recorded under, checked against the caller."""
    session_id = requested_session_id(principal, request, body)
    if session_id is None:
        if principal.key is None or not state.config.gateway.auto_session:
            return None
        return await open_key_session(state, principal.key)
    session = await cached_session(state, session_id)
    if session is None:
        raise OpenAIError(404, f"session {session_id!r} does not exist", param="session_id",
                          code="session_not_found")
    if not principal.is_admin and session.api_key_id not in (None, principal.key_id):
        raise OpenAIError(403, f"session {session_id!r} belongs to another key",
                          type="permission_error", param="session_id", code="session_forbidden")
    if session.status != "open" and principal.key is not None and principal.key.kind == "user" \
            and principal.key.session_id == session_id and state.config.gateway.auto_session:
        return await open_key_session(state, principal.key)  # the bound one timed out
    if session.status != "open":
        raise OpenAIError(409, f"session {session_id!r} is {session.status}; start a new one",
                          param="session_id", code="session_closed")
    return session_id


async def open_key_session(state: GatewayState, key: ApiKeyRecord) -> str:
    """Open a session for a user key that has none (or whose session ended) and bind it.
    Concurrent first calls of one key may each open one; the last binding wins and the
    others end by idle timeout, each a complete episode of its own."""
    session = SessionRecord(id=f"sess_{uuid.uuid4().hex}", api_key_id=key.id,
                            metadata={"opened_by": "auto_session"})
    async with admit_sessions(state, 1):
        session = await asyncio.to_thread(state.store.add_session, session)
    await asyncio.to_thread(state.store.bind_key_session, key.id, session.id)
    state.keys.forget(key.key_hash)
    remember_new_session(state, session)
    return session.id


def remember_new_session(state: GatewayState, session: SessionRecord) -> None:
    """Cache a session this process just inserted: its first turns need no store reads
    (the session row, the parent-linking entries)."""
    state.session_cache.put(session.id, session)
    state.linker.track_new(session.id)


async def cached_session(state: GatewayState, session_id: str) -> SessionRecord | None:
    """The session, from this process's `RefreshingCache` (see `GatewayState`) or the
    store: a store trip per request was ~11% of the gateway's CPU under load."""
    return await state.session_cache.get(session_id)


def check_session_access(principal: Principal, session: SessionRecord) -> None:
    """403 unless the caller is the admin or holds the session's own key."""
    if principal.is_admin:
        return
    if principal.key is not None and principal.key.session_id == session.id:
        return
    if principal.key is not None and session.api_key_id == principal.key.id:
        return
    raise OpenAIError(403, f"this key cannot act on session {session.id!r}",
                      type="permission_error", param="session_id", code="session_forbidden")


async def load_session(state: GatewayState, session_id: str) -> SessionRecord:
    """The session (read from the store, not the cache), or 404 `session_not_found`."""
    session = await asyncio.to_thread(state.store.get_session, session_id)
    if session is None:
        raise OpenAIError(404, f"session {session_id!r} does not exist", param="session_id",
                          code="session_not_found")
    return session
