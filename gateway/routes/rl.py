"""Episodes over REST: start sessions (singly or as a GRPO group), refresh a long-lived
key onto a fresh session, end, inspect and list them.

Keys: the admin key manages everything; a session key acts only on its own session; a
user (virtual) key may refresh itself onto a new session (OpenClaw-style runtimes keep
one key for many episodes).
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body
from pydantic import BaseModel, ConfigDict, Field, model_validator

from areal_service.keys import hash_key, new_api_key
from areal_service.store.group_membership import GroupRefused, GroupRule
from areal_service.types import (
    DEFAULT_POLICY,
    END_FAILED,
    END_NO_REWARD,
    SessionRecord,
    SessionStatus,
)
from gateway.admission import admit_sessions
from gateway.deps import AdminDep, PageLimit, PageOffset, PrincipalDep, StateDep
from gateway.errors import ErrorBody, OpenAIError, invalid_api_key
from gateway.policies import checked_policy
from gateway.routes.views import record_view
from gateway.sessions import (
    check_session_access,
    load_session,
    remember_new_session,
    session_closed,
)
from gateway.state import GatewayState

router = APIRouter(
    prefix="/rl", responses={code: {"model": ErrorBody} for code in (400, 401, 403, 404, 409)}
)


class SessionStart(BaseModel):
    """Body of `POST /rl/sessions` (optional: an empty body opens one session)."""

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
    policy: str | None = Field(None, max_length=63)
    """The policy that serves and trains the new sessions (admin only; a key's sessions
    take the key's policy). None: the default policy."""


class SessionEnd(BaseModel):
    """Body of `POST /rl/sessions/{id}/end` (optional: an empty body ends it plainly)."""

    model_config = ConfigDict(extra="forbid")
    no_reward: bool = False
    """Declare that no reward will come: the trainer does not wait `trainer.reward_wait_s`
    for one, and `trainer.unrewarded_policy` applies at once (end reason `no_reward`)."""
    failed: bool = False
    """The agent failed (it raised, or gave up): the trainer drops this session alone
    (drop reason `failed: ...`) and its group trains on the rest (end reason `failed`)."""

    @model_validator(mode="after")
    def _one_reason(self) -> SessionEnd:
        if self.no_reward and self.failed:
            raise ValueError("set at most one of no_reward and failed")
        return self


class SessionView(BaseModel):
    """A session as the REST API shows it."""

    session_id: str
    group_id: str | None
    task_id: str | None
    status: SessionStatus
    metadata: dict[str, Any]
    created_at: float
    last_activity_at: float | None
    ended_at: float | None
    end_reason: str | None
    policy: str = DEFAULT_POLICY
    """The policy that serves and trains the session."""
    parent_session_id: str | None = None
    """Set on a role sub-session of a multi-agent episode (`gateway/roles.py`): the
    episode's own session; `policy` is the role."""
    drop_reason: str | None = None
    """With `status: dropped`: why the trainer dropped the episode (e.g. `stale: 9
    versions > max_train_staleness 8`, `unrewarded: ...`, `group incomplete: ...`,
    `failed: ...`); its completions and rewards stay readable here."""

    @classmethod
    def of(cls, session: SessionRecord) -> SessionView:
        return record_view(cls, session, session_id=session.id)


class NewSession(SessionView):
    api_key: str
    """The session's own key: shown only here."""


class SessionsStarted(BaseModel):
    """Reply of `POST /rl/sessions` by the admin: the group and each session's key (the
    first session's id and key repeated at the top, for the common group_size 1)."""

    group_id: str | None
    session_id: str
    api_key: str
    sessions: list[NewSession]


class SessionRefreshed(SessionView):
    """Reply of a refresh: the key's new session."""

    previous_session_id: str | None


class SessionEnded(SessionView):
    completions: int
    """How many completions the episode recorded."""


class CompletionSummary(BaseModel):
    id: str
    parent_id: str | None
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    created_at: float


class RewardSummary(BaseModel):
    id: str
    name: str
    value: float
    completion_id: str | None
    session_id: str | None
    group_id: str | None


class SessionDetail(SessionView):
    completions: list[CompletionSummary]
    rewards: list[RewardSummary]
    roles: list[SessionView] = Field(default_factory=list)
    """A multi-agent episode's role sub-sessions (their completions and rewards are read
    at `GET /rl/sessions/{role's id}`); empty for an episode of one policy."""


class SessionList(BaseModel):
    object: Literal["list"] = "list"
    data: list[SessionView]


def new_session_id() -> str:
    """A fresh session id."""
    return f"sess_{uuid.uuid4().hex}"


async def open_session(
    state: GatewayState,
    *,
    group_id: str | None,
    task_id: str | None,
    metadata: dict[str, Any],
    key_id: str | None,
    session_id: str | None = None,
    admission: str | None = None,
    policy: str = DEFAULT_POLICY,
    group_rule: GroupRule | None = None,
) -> SessionRecord:
    """Insert one open session (the staleness gate, when configured, runs before this
    and gives its reservation: `admission`; `group_rule`: who may join `group_id`,
    checked in the insert's transaction)."""
    record = SessionRecord(
        id=session_id or new_session_id(),
        group_id=group_id,
        task_id=task_id,
        api_key_id=key_id,
        metadata=metadata,
        policy=policy,
    )
    try:
        session = await asyncio.to_thread(
            state.store.add_session, record, admission, group_rule=group_rule
        )
    except GroupRefused as refused:
        raise _group_error(refused) from None
    remember_new_session(state, session)
    return session


@router.post("/sessions", status_code=201)
async def start_sessions(
    state: StateDep, principal: PrincipalDep, body: Annotated[SessionStart | None, Body()] = None
) -> SessionsStarted | SessionRefreshed:
    """Open `group_size` sessions (one fresh session key each), or refresh a user key."""
    body = body or SessionStart()
    policy = await checked_policy(state, body.policy)
    if not principal.is_admin:
        if principal.key is None or principal.key.kind != "user":
            raise OpenAIError(
                403,
                "only the admin key or a user key may start sessions",
                type="permission_error",
                code="admin_required",
            )
        if body.policy is not None and policy != principal.key.policy:
            raise OpenAIError(
                403,
                "a key's sessions take the key's policy; only the admin key names another",
                type="permission_error",
                param="policy",
                code="policy_forbidden",
            )
        return await _refresh(state, principal.key.id, body)
    if body.api_key is not None:
        key = await asyncio.to_thread(state.store.keys.find_api_key_by_hash, hash_key(body.api_key))
        if key is None or key.revoked_at is not None or key.kind != "user":
            raise invalid_api_key(body.api_key)
        return await _refresh(state, key.id, body)
    await _check_group(state, body.group_id, GroupRule(owner=None))
    group_id = body.group_id or (f"grp_{uuid.uuid4().hex}" if body.group_size > 1 else None)
    sessions = []
    async with admit_sessions(state, body.group_size, policy) as admission:
        for _ in range(body.group_size):
            session_id = new_session_id()
            plaintext, key = new_api_key(kind="session", session_id=session_id)
            key = dataclasses.replace(key, policy=policy)
            await asyncio.to_thread(state.store.keys.add_api_key, key)
            session = await open_session(
                state,
                group_id=group_id,
                task_id=body.task_id,
                metadata=body.metadata,
                key_id=key.id,
                session_id=session_id,
                admission=admission,
                policy=policy,
                group_rule=GroupRule(owner=None),
            )
            state.keys.remember(key)  # its first request needs no store lookup
            sessions.append(NewSession(**SessionView.of(session).model_dump(), api_key=plaintext))
    return SessionsStarted(
        group_id=group_id,
        session_id=sessions[0].session_id,
        api_key=sessions[0].api_key,
        sessions=sessions,
    )


def _group_error(refused: GroupRefused) -> OpenAIError:
    """A refused group join as its error: 403 for a user key, 409 for the admin."""
    if refused.code == "group_not_owned":
        return OpenAIError(
            403,
            f"group {refused.group_id!r} belongs to another key",
            type="permission_error",
            param="group_id",
            code="group_not_owned",
        )
    return OpenAIError(
        409,
        f"group {refused.group_id!r} is already used by a user key's "
        "sessions; choose another group id",
        param="group_id",
        code="group_in_use",
    )


async def _check_group(state: GatewayState, group_id: str | None, rule: GroupRule) -> None:
    """The early answer for a group `rule` may not join (before any key is minted or a
    session ended); the insert checks again under the group's lock
    (`group_membership.py`), so racing joins never mix two keys in one group."""
    if group_id is None:
        return
    refused = await asyncio.to_thread(state.store.group_refusal, group_id, rule)
    if refused is not None:
        raise _group_error(refused)


async def _refresh(state: GatewayState, key_id: str, body: SessionStart) -> SessionRefreshed:
    """End the key's current session (reason `refresh`) and bind it to a new one."""
    if body.group_size != 1:
        raise OpenAIError(400, "a refresh opens exactly one session", param="group_size")
    key = await asyncio.to_thread(state.store.keys.get_api_key, key_id)
    assert key is not None
    if body.policy is not None and body.policy != key.policy:
        raise OpenAIError(
            400,
            f"the key is bound to policy {key.policy!r}; its sessions cannot take another",
            param="policy",
            code="policy_mismatch",
        )
    # A group is joined only by its own key's sessions (the admin's never join it).
    await _check_group(state, body.group_id, GroupRule(owner=key_id))
    async with admit_sessions(state, 1, key.policy, key_id) as admission:
        if key.session_id is not None:
            await state.end_session(key.session_id, "refresh")
        session = await open_session(
            state,
            group_id=body.group_id,
            task_id=body.task_id,
            metadata=body.metadata,
            key_id=key_id,
            admission=admission,
            policy=key.policy,
            group_rule=GroupRule(owner=key_id),
        )
    await asyncio.to_thread(state.store.keys.bind_key_session, key_id, session.id)
    state.keys.forget(key.key_hash)
    return SessionRefreshed(
        **SessionView.of(session).model_dump(), previous_session_id=key.session_id
    )


@router.post("/sessions/{session_id}/end")
async def end_session(
    session_id: str,
    state: StateDep,
    principal: PrincipalDep,
    body: Annotated[SessionEnd | None, Body()] = None,
) -> SessionEnded:
    """End an open session (409 if it already ended): its episode becomes trainable once
    rewarded."""
    session = await load_session(state, session_id)
    check_session_access(principal, session)
    if session.parent_session_id is not None:
        raise OpenAIError(
            400,
            f"session {session_id!r} is a role of episode {session.parent_session_id!r} "
            "and ends with it; end the episode's session",
            param="session_id",
            code="role_session",
        )
    if session.status != "open":
        raise session_closed(session_id, f"already {session.status} ({session.end_reason})")
    reason = "client"
    if body is not None and body.no_reward:
        reason = END_NO_REWARD
    elif body is not None and body.failed:
        reason = END_FAILED
    ended = await state.end_session(session_id, reason)
    assert ended is not None
    count = len(await asyncio.to_thread(state.store.list_completions, session_id))
    return SessionEnded(**SessionView.of(ended).model_dump(), completions=count)


@router.get("/sessions/{session_id}")
async def get_session(session_id: str, state: StateDep, principal: PrincipalDep) -> SessionDetail:
    """The session with its completion ids and rewards."""
    session = await load_session(state, session_id)
    check_session_access(principal, session)
    completions = await asyncio.to_thread(state.store.list_completions, session_id)
    group = [session.group_id] if session.group_id else []
    rewards = await asyncio.to_thread(state.store.load_rewards, [session_id], group)
    roles = []
    if state.policy_registry.declared and session.parent_session_id is None:
        roles = await asyncio.to_thread(
            state.store.list_sessions, parent_session_id=session_id, limit=1000
        )
    return SessionDetail(
        **SessionView.of(session).model_dump(),
        completions=[record_view(CompletionSummary, c) for c in completions],
        rewards=[record_view(RewardSummary, r) for r in rewards],
        roles=[SessionView.of(r) for r in reversed(roles)],
    )


@router.get("/sessions")
async def list_sessions(
    state: StateDep,
    _: AdminDep,
    status: SessionStatus | None = None,
    group_id: str | None = None,
    task_id: str | None = None,
    parent_session_id: str | None = None,
    limit: PageLimit = 100,
    offset: PageOffset = 0,
) -> SessionList:
    """Sessions, newest first, filtered (at most 1000 per page; `parent_session_id`: a
    multi-agent episode's role sub-sessions)."""
    rows = await asyncio.to_thread(
        state.store.list_sessions,
        status=status,
        group_id=group_id,
        task_id=task_id,
        parent_session_id=parent_session_id,
        limit=min(limit, 1000),
        offset=offset,
    )
    return SessionList(data=[SessionView.of(s) for s in rows])
