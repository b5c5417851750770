"""Which session (episode) a request belongs to, without client code changes.

Sources, in order: a session-scoped key; an `x-session-id` header; `metadata.session_id`
in the body. A named session must exist and belong to the caller's key (admin may name
any). No session at all is fine: the completion is recorded unattached.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request

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
        return None
    session = await asyncio.to_thread(state.store.get_session, session_id)
    if session is None:
        raise OpenAIError(404, f"session {session_id!r} does not exist", param="session_id",
                          code="session_not_found")
    if not principal.is_admin and session.api_key_id not in (None, principal.key_id):
        raise OpenAIError(403, f"session {session_id!r} belongs to another key",
                          type="permission_error", param="session_id", code="session_forbidden")
    if session.status != "open":
        raise OpenAIError(409, f"session {session_id!r} is {session.status}; start a new one",
                          param="session_id", code="session_closed")
    return session_id
