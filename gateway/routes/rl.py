"""Episodes over REST: start sessions (singly or as a GRPO group), refresh a long-lived
key onto a fresh session, end, inspect and list them.

Keys: the admin key manages everything; a session key acts only on its own session; a
user (virtual) key may refresh itself onto a new session (OpenClaw-style runtimes keep
one key for many episodes).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from areal_service.keys import hash_key, new_api_key
from areal_service.store.episode_reads import load_rewards
from areal_service.types import SessionRecord, SessionStatus
from gateway.admission import admit_sessions
from gateway.auth import Principal
from gateway.deps import AdminDep, PrincipalDep, StateDep, parse_model, read_json
from gateway.errors import OpenAIError, invalid_api_key
from gateway.sessions import remember_new_session
from gateway.state import GatewayState

router = APIRouter(prefix="/rl")


class SessionStart(BaseModel):
    """Body of `POST /rl/sessions`."""

    model_config = ConfigDict(extra="forbid")
    group_id: str | None = Field(None, max_length=200)
    """GRPO group; with `group_size` > 1 a fresh one is made when omitted."""
    task_id: str | None = Field(None, max_length=200)
    metadata: dict[str, Any] = Field(default_factory=dict)
    group_size: int = Field(1, ge=1, le=1024)
    """How many sessions to open in one group (one key each)."""
    api_key: str | None = None
    """Refresh: a long-lived virtual key to rebind to the new session (its previous
    session ends with reason `refresh`). Admin only; a user key refreshes itself."""


def session_view(session: SessionRecord) -> dict[str, Any]:
    """A session as the REST API shows it."""
    return {"session_id": session.id, "group_id": session.group_id, "task_id": session.task_id,
            "status": session.status, "metadata": session.metadata,
            "created_at": session.created_at, "last_activity_at": session.last_activity_at,
            "ended_at": session.ended_at, "end_reason": session.end_reason}


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
    """The session, or 404 `session_not_found`."""
    session = await asyncio.to_thread(state.store.get_session, session_id)
    if session is None:
        raise OpenAIError(404, f"session {session_id!r} does not exist", param="session_id",
                          code="session_not_found")
    return session


def new_session_id() -> str:
    """A fresh session id."""
    return f"sess_{uuid.uuid4().hex}"


async def open_session(state: GatewayState, *, group_id: str | None, task_id: str | None,
                       metadata: dict[str, Any], key_id: str | None,
                       session_id: str | None = None) -> SessionRecord:
    """Insert one open session (the staleness gate, when configured, runs before this)."""
    record = SessionRecord(id=session_id or new_session_id(), group_id=group_id,
                           task_id=task_id, api_key_id=key_id, metadata=metadata)
    session = await asyncio.to_thread(state.store.add_session, record)
    remember_new_session(state, session)
    return session


@router.post("/sessions", status_code=201)
async def start_sessions(request: Request, state: StateDep, principal: PrincipalDep
                         ) -> dict[str, Any]:
    """Open `group_size` sessions (one fresh session key each), or refresh a user key."""
    body = parse_model(SessionStart, await read_json(request, allow_empty=True))
    if not principal.is_admin:
        if principal.key is None or principal.key.kind != "user":
            raise OpenAIError(403, "only the admin key or a user key may start sessions",
                              type="permission_error", code="admin_required")
        return await _refresh(state, principal.key.id, body)
    if body.api_key is not None:
        key = await asyncio.to_thread(state.store.find_api_key_by_hash, hash_key(body.api_key))
        if key is None or key.revoked_at is not None or key.kind != "user":
            raise invalid_api_key(body.api_key)
        return await _refresh(state, key.id, body)
    group_id = body.group_id or (f"grp_{uuid.uuid4().hex}" if body.group_size > 1 else None)
    sessions = []
    async with admit_sessions(state, body.group_size):
        for _ in range(body.group_size):
            session_id = new_session_id()
            plaintext, key = new_api_key(kind="session", session_id=session_id)
            await asyncio.to_thread(state.store.add_api_key, key)
            session = await open_session(state, group_id=group_id, task_id=body.task_id,
                                         metadata=body.metadata, key_id=key.id,
                                         session_id=session_id)
            state.keys.remember(key)  # its first request needs no store lookup
            sessions.append({**session_view(session), "api_key": plaintext})
    return {"group_id": group_id, "session_id": sessions[0]["session_id"],
            "api_key": sessions[0]["api_key"], "sessions": sessions}


async def _refresh(state: GatewayState, key_id: str, body: SessionStart) -> dict[str, Any]:
    """End the key's current session (reason `refresh`) and bind it to a new one."""
    if body.group_size != 1:
        raise OpenAIError(400, "a refresh opens exactly one session", param="group_size")
    key = await asyncio.to_thread(state.store.get_api_key, key_id)
    assert key is not None
    async with admit_sessions(state, 1):
        if key.session_id is not None:
            await state.end_session(key.session_id, "refresh")
        session = await open_session(state, group_id=body.group_id, task_id=body.task_id,
                                     metadata=body.metadata, key_id=key_id)
    await asyncio.to_thread(state.store.bind_key_session, key_id, session.id)
    state.keys.forget(key.key_hash)
    return {**session_view(session), "group_id": session.group_id,
            "previous_session_id": key.session_id}


@router.post("/sessions/{session_id}/end")
async def end_session(session_id: str, state: StateDep, principal: PrincipalDep
                      ) -> dict[str, Any]:
    """End an open session (409 if it already ended): its episode becomes trainable once
    rewarded."""
    session = await load_session(state, session_id)
    check_session_access(principal, session)
    if session.status != "open":
        raise OpenAIError(409, f"session {session_id!r} already {session.status} "
                          f"({session.end_reason})", param="session_id",
                          code="session_closed")
    ended = await state.end_session(session_id, "client")
    assert ended is not None
    count = len(await asyncio.to_thread(state.store.list_completions, session_id))
    return {**session_view(ended), "completions": count}


@router.get("/sessions/{session_id}")
async def get_session(session_id: str, state: StateDep, principal: PrincipalDep
                      ) -> dict[str, Any]:
    """The session with its completion ids and rewards."""
    session = await load_session(state, session_id)
    check_session_access(principal, session)
    completions = await asyncio.to_thread(state.store.list_completions, session_id)
    group = [session.group_id] if session.group_id else []
    rewards = await asyncio.to_thread(load_rewards, state.store, [session_id], group)
    return {**session_view(session),
            "completions": [{"id": c.id, "parent_id": c.parent_id,
                             "prompt_tokens": c.prompt_tokens,
                             "completion_tokens": c.completion_tokens,
                             "finish_reason": c.finish_reason, "created_at": c.created_at}
                            for c in completions],
            "rewards": [{"id": r.id, "name": r.name, "value": r.value,
                         "completion_id": r.completion_id, "session_id": r.session_id,
                         "group_id": r.group_id} for r in rewards]}


@router.get("/sessions")
async def list_sessions(state: StateDep, _: AdminDep, status: SessionStatus | None = None,
                        group_id: str | None = None, task_id: str | None = None,
                        limit: int = 100, offset: int = 0) -> dict[str, Any]:
    """Sessions, newest first, filtered."""
    rows = await asyncio.to_thread(state.store.list_sessions, status=status, group_id=group_id,
                                   task_id=task_id, limit=min(limit, 1000), offset=offset)
    return {"object": "list", "data": [session_view(s) for s in rows]}

