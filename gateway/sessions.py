"""Which session (episode) a request belongs to, without client code changes.

Sources, in the order `gateway.sessions.sources` lists them: `key` (a session-scoped key);
`header` (`x-session-id`); `metadata` (`metadata.session_id` in the body): a session so
named must exist and belong to the caller's key (admin may name any; a session with no
key is the admin's, e.g. its coding agent's, and no user key may name it). `client_metadata`:
a coding agent's own conversation id (Codex's `client_metadata.thread_id` /
`session_id` or `thread-id` / `session-id` headers; Claude Code's
`x-claude-code-session-id` header or the `session_id` inside `metadata.user_id`), mapped
per key to a session id derived from it and opened on first use, so one agent thread is
one episode without client changes. Otherwise a user key's bound (or auto-opened)
session; no session at all is fine: the completion is recorded unattached. Also the
access rule of the session routes (`routes/rl.py`, `routes/rewards.py`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from areal_service.types import DEFAULT_POLICY, ApiKeyRecord, SessionRecord
from gateway.admission import admit_sessions
from gateway.auth import Principal
from gateway.errors import OpenAIError
from gateway.state import GatewayState

ClientSession = tuple[str, str]
"""(derived session id, the agent's own conversation id) of a `client_metadata` source."""

_CLIENT_HEADERS = (
    "x-claude-code-session-id",
    "thread-id",
    "session-id",
    "session_id",
    "conversation_id",
)
_USER_ID_SESSION = re.compile(r"session_([0-9A-Za-z-]{8,})")


def client_conversation_id(headers: Mapping[str, str], body: dict[str, Any]) -> str | None:
    """The coding agent's own conversation id, if it sent one (see the module doc)."""
    meta = body.get("client_metadata")
    if isinstance(meta, dict):
        for key in ("thread_id", "session_id"):
            if isinstance(meta.get(key), str) and meta[key]:
                return str(meta[key])
    for name in _CLIENT_HEADERS:
        value = headers.get(name)
        if value:
            return value
    user = (
        body.get("metadata", {}).get("user_id") if isinstance(body.get("metadata"), dict) else None
    )
    if isinstance(user, str):  # Claude Code: a JSON object, or "user_..._session_<id>"
        try:
            parsed = json.loads(user)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict) and isinstance(parsed.get("session_id"), str):
            return str(parsed["session_id"]) or None
        match = _USER_ID_SESSION.search(user)
        if match:
            return match.group(1)
    return None


def client_session_id(principal: Principal, conversation_id: str) -> str:
    """The session id of an agent conversation under the caller's key: derived, so every
    replica maps it alike, and per key, so two keys never share (or squat) one."""
    owner = principal.key_id or "admin"
    digest = hashlib.sha256(f"{owner}\0{conversation_id}".encode()).hexdigest()[:32]
    return f"sess_c{digest}"


def requested_session(
    principal: Principal,
    headers: Mapping[str, str],
    body: dict[str, Any],
    sources: Sequence[str] = ("key", "header", "metadata"),
) -> str | ClientSession | None:
    """The session the request names, by `sources` in order (then a user key's bound
    session): an id, or a `ClientSession` for an agent's own conversation id."""
    for source in sources:
        if source == "key":
            if principal.key is not None and principal.key.kind == "session":
                return principal.key.session_id
        elif source == "header":
            header = headers.get("x-session-id")
            if header:
                return header
        elif source == "metadata":
            metadata = body.get("metadata")
            if isinstance(metadata, dict) and isinstance(metadata.get("session_id"), str):
                return str(metadata["session_id"])
        elif source == "client_metadata":
            conversation = client_conversation_id(headers, body)
            if conversation:
                return client_session_id(principal, conversation), conversation
    if principal.key is not None:
        return principal.key.session_id  # a user key's current session, if bound
    return None


def session_not_found(session_id: str) -> OpenAIError:
    """404 `session_not_found`: no session of that id."""
    return OpenAIError(
        404, f"session {session_id!r} does not exist", param="session_id", code="session_not_found"
    )


def session_closed(session_id: str, why: str) -> OpenAIError:
    """409 `session_closed`: the session has ended; `why` completes "session '...' ..."."""
    return OpenAIError(
        409, f"session {session_id!r} {why}", param="session_id", code="session_closed"
    )


async def session_for_request(
    state: GatewayState, principal: Principal, headers: Mapping[str, str], body: dict[str, Any]
) -> str | None:
    """The open session this completion is recorded under, checked against the caller."""
    found = requested_session(principal, headers, body, state.config.gateway.sessions.sources)
    if isinstance(found, tuple):
        return await client_session(state, principal, *found)
    session_id = found
    if session_id is None:
        if principal.key is None or not state.config.gateway.sessions.auto_open:
            return None
        return await open_key_session(state, principal.key)
    session = await cached_session(state, session_id)
    if session is None:
        raise session_not_found(session_id)
    # A session without a key is the admin's (its coding agent's conversations): no
    # user key may write into it, as into no other key's.
    if not principal.is_admin and session.api_key_id != principal.key_id:
        raise OpenAIError(
            403,
            f"session {session_id!r} belongs to another key",
            type="permission_error",
            param="session_id",
            code="session_forbidden",
        )
    if (
        session.status != "open"
        and principal.key is not None
        and principal.key.kind == "user"
        and principal.key.session_id == session_id
        and state.config.gateway.sessions.auto_open
    ):
        return await open_key_session(state, principal.key)  # the bound one timed out
    if session.status != "open":
        raise session_closed(session_id, f"is {session.status}; start a new one")
    return session_id


async def client_session(
    state: GatewayState, principal: Principal, session_id: str, conversation_id: str
) -> str:
    """The open session of an agent conversation, opened on its first turn. Once ended
    (rewarded, idle) a later turn of the same conversation is 409 `session_closed`: an
    episode is not reopened; the agent starts a new thread."""
    session = await cached_session(state, session_id)
    if session is None:
        record = SessionRecord(
            id=session_id,
            api_key_id=principal.key_id,
            metadata={"opened_by": "client_metadata", "client_session": conversation_id},
            policy=DEFAULT_POLICY if principal.key is None else principal.key.policy,
        )
        try:
            user = principal.key is not None and principal.key.kind == "user"
            async with admit_sessions(
                state, 1, record.policy, principal.key_id if user else None
            ) as admission:
                session = await asyncio.to_thread(state.store.add_session, record, admission)
        except Exception:  # a concurrent first turn inserted it first
            session = await asyncio.to_thread(state.store.get_session, session_id)
            if session is None:
                raise
        remember_new_session(state, session)
    if session.status != "open":
        raise OpenAIError(
            409,
            f"session {session_id!r} of conversation {conversation_id!r} "
            f"is {session.status}; start a new conversation",
            param="session_id",
            code="session_closed",
        )
    return session_id


async def open_key_session(state: GatewayState, key: ApiKeyRecord) -> str:
    """Open a session for a user key that has none (or whose session ended) and bind it.
    Concurrent first calls of one key may each open one; the last binding wins and the
    others end by idle timeout, each a complete episode of its own."""
    session = SessionRecord(
        id=f"sess_{uuid.uuid4().hex}",
        api_key_id=key.id,
        metadata={"opened_by": "auto_session"},
        policy=key.policy,
    )
    async with admit_sessions(state, 1, session.policy, key.id) as admission:
        session = await asyncio.to_thread(state.store.add_session, session, admission)
    await asyncio.to_thread(state.store.keys.bind_key_session, key.id, session.id)
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
    raise OpenAIError(
        403,
        f"this key cannot act on session {session.id!r}",
        type="permission_error",
        param="session_id",
        code="session_forbidden",
    )


async def load_session(state: GatewayState, session_id: str) -> SessionRecord:
    """The session (read from the store, not the cache), or 404 `session_not_found`."""
    session = await asyncio.to_thread(state.store.get_session, session_id)
    if session is None:
        raise session_not_found(session_id)
    return session
