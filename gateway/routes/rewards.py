"""`POST /v1/rewards`: a named score on a completion, a session (episode) or a group.

Idempotent by a client-chosen `id`, scoped to the posting key (a retried post is a
no-op; the same id with other values is a 409; another key's ids are invisible). 404 for
an unknown target, 409 once the episode was claimed for training, 400 for a non-finite
value or one beyond `gateway.reward_max_abs`. Session keys may score only their own
session.

Returns stay finite by construction: a return sums at most every reward of a session and
its group, each bounded by the cap (default 1e6), and n * cap cannot overflow a float for
any realistic n (past 1e302 rewards at the default). A per-reward bound costs nothing per
post and holds under concurrent posts, where a check summing the session's rewards so far
would read them all on every post and could pass two racing posts that overflow together.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from typing import Any, Literal

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field, model_validator

from areal_service.types import RewardRecord, SessionRecord
from gateway.auth import Principal
from gateway.deps import PrincipalDep, StateDep
from gateway.errors import OpenAIError, bad_request
from gateway.replies import ErrorBody
from gateway.sessions import check_session_access, load_session
from gateway.state import GatewayState

router = APIRouter(responses={code: {"model": ErrorBody} for code in (400, 401, 403, 404, 409)})
_TRAINING = ("claimed", "trained", "dropped")


class RewardCreate(BaseModel):
    """Body of `POST /v1/rewards`: exactly one of completion_id, session_id, group_id."""

    model_config = ConfigDict(extra="forbid")
    id: str | None = Field(None, max_length=200)
    """Client-chosen id; posting the same id again is a no-op."""
    completion_id: str | None = None
    session_id: str | None = None
    group_id: str | None = None
    value: float
    name: str = Field("reward", max_length=200)
    metadata: dict[str, Any] = Field(default_factory=dict)
    end_session: bool = False
    """End the target session with this reward (reason `reward`)."""

    @model_validator(mode="after")
    def _one_target(self) -> RewardCreate:
        targets = [t for t in (self.completion_id, self.session_id, self.group_id) if t]
        if len(targets) != 1:
            raise ValueError("name exactly one target: completion_id, session_id or group_id")
        return self


class Reward(BaseModel):
    """A reward as the API returns it."""

    id: str
    object: Literal["reward"] = "reward"
    name: str
    value: float
    completion_id: str | None
    session_id: str | None
    group_id: str | None
    metadata: dict[str, Any]
    created_at: float

    @classmethod
    def of(cls, r: RewardRecord) -> Reward:
        return cls(id=r.id, name=r.name, value=r.value, completion_id=r.completion_id,
                   session_id=r.session_id, group_id=r.group_id, metadata=r.metadata,
                   created_at=r.created_at)


async def _target_session(state: GatewayState, principal: Principal, body: RewardCreate
                          ) -> SessionRecord | None:
    """The session the reward lands on (None for a group reward), access-checked."""
    session_id = body.session_id
    if body.completion_id:
        completion = await asyncio.to_thread(state.store.get_completion, body.completion_id)
        if completion is None:
            raise OpenAIError(404, f"completion {body.completion_id!r} does not exist",
                              param="completion_id", code="completion_not_found")
        if completion.session_id is None:
            if not principal.is_admin:
                raise OpenAIError(403, "only the admin key may score a completion outside a "
                                  "session", type="permission_error", param="completion_id")
            return None
        session_id = completion.session_id
    if session_id is None:  # a group reward
        if not principal.is_admin:
            raise OpenAIError(403, "only the admin key may score a whole group",
                              type="permission_error", param="group_id")
        count = await asyncio.to_thread(state.store.count_sessions, group_id=body.group_id)
        if count == 0:
            raise OpenAIError(404, f"group {body.group_id!r} has no sessions",
                              param="group_id", code="group_not_found")
        return None
    session = await load_session(state, session_id)
    check_session_access(principal, session)
    return session


@router.post("/v1/rewards", status_code=201)
@router.post("/rewards", status_code=201, include_in_schema=False)
async def post_reward(body: RewardCreate, state: StateDep, principal: PrincipalDep
                      ) -> Reward:
    """Record a reward (see the module docstring for the rules)."""
    if not math.isfinite(body.value):
        raise bad_request(f"value must be a finite number, got {body.value}", "value")
    cap = state.config.gateway.reward_max_abs
    if abs(body.value) > cap:
        raise bad_request(f"|value| must be at most {cap:g} (gateway.reward_max_abs), got "
                          f"{body.value:g}", "value")
    owner = "" if principal.is_admin else (principal.key_id or "")
    if body.id is not None:
        existing = await asyncio.to_thread(state.store.get_reward, body.id, owner)
        if existing is not None:
            return _same_or_conflict(existing, body)
    session = await _target_session(state, principal, body)
    if session is not None and session.status in _TRAINING:
        raise OpenAIError(409, f"session {session.id!r} is already {session.status}; its "
                          "rewards can no longer change", param="session_id",
                          code="session_trained")
    record = RewardRecord(id=body.id or f"rwd_{uuid.uuid4().hex}", value=body.value,
                          name=body.name, completion_id=body.completion_id,
                          session_id=body.session_id, group_id=body.group_id,
                          metadata=body.metadata, owner=owner)
    stored = await asyncio.to_thread(state.store.add_reward, record)
    if body.end_session and session is not None and session.status == "open":
        await state.end_session(session.id, "reward")
    if stored != record:  # lost a race with the same id
        return _same_or_conflict(stored, body)
    return Reward.of(stored)


def _same_or_conflict(existing: RewardRecord, body: RewardCreate) -> Reward:
    same = (existing.value == body.value and existing.name == body.name
            and existing.completion_id == body.completion_id
            and existing.session_id == body.session_id and existing.group_id == body.group_id)
    if not same:
        raise OpenAIError(409, f"reward id {existing.id!r} was already used with other values",
                          param="id", code="reward_id_conflict")
    return Reward.of(existing)
