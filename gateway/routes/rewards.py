"""`POST /v1/rewards`: a named score on a completion, a session (episode) or a group.

Idempotent by a client-chosen `id`, scoped to the posting key (a retried post is a
no-op; the same id with other values is a 409; another key's ids are invisible). 404 for
an unknown target; 409 `session_trained` once the session, or any session of the scored
group, was claimed for training (checked in the insert's transaction, so no reward is
acknowledged and then missed by a claim); 409 `reward_exists` for a second reward of the
same `name` on the same target unless the body says `additive: true` (rewards on one
target add up); 400 for a non-finite value or one beyond `gateway.limits.reward_max_abs`.
Session keys may score only their own session. The reply's `target_total` is the sum of
every reward now on the target.

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

from areal_service.store.reward_admission import RewardRefused
from areal_service.types import DEFAULT_POLICY, RewardRecord, SessionRecord
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
    additive: bool = False
    """Add to a reward of the same `name` already on the target instead of a 409."""

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
    target_total: float
    """Sum of every reward on this reward's target (completion, session or group) now:
    what the target's return is built from."""

    @classmethod
    def of(cls, r: RewardRecord, target_total: float) -> Reward:
        return cls(
            id=r.id,
            name=r.name,
            value=r.value,
            completion_id=r.completion_id,
            session_id=r.session_id,
            group_id=r.group_id,
            metadata=r.metadata,
            created_at=r.created_at,
            target_total=target_total,
        )


async def _target_session(
    state: GatewayState, principal: Principal, body: RewardCreate
) -> SessionRecord | None:
    """The session the reward lands on (None for a group reward), access-checked."""
    session_id = body.session_id
    if body.completion_id:
        completion = await asyncio.to_thread(state.store.get_completion, body.completion_id)
        if completion is None:
            raise OpenAIError(
                404,
                f"completion {body.completion_id!r} does not exist",
                param="completion_id",
                code="completion_not_found",
            )
        if completion.session_id is None:
            if not principal.is_admin:
                raise OpenAIError(
                    403,
                    "only the admin key may score a completion outside a session",
                    type="permission_error",
                    param="completion_id",
                )
            return None
        session_id = completion.session_id
    if session_id is None:  # a group reward
        if not principal.is_admin:
            raise OpenAIError(
                403,
                "only the admin key may score a whole group",
                type="permission_error",
                param="group_id",
            )
        count = await asyncio.to_thread(state.store.count_sessions, group_id=body.group_id)
        if count == 0:
            raise OpenAIError(
                404,
                f"group {body.group_id!r} has no sessions",
                param="group_id",
                code="group_not_found",
            )
        return None
    session = await load_session(state, session_id)
    check_session_access(principal, session)
    return session


@router.post("/v1/rewards", status_code=201)
@router.post("/rewards", status_code=201, include_in_schema=False)
async def post_reward(body: RewardCreate, state: StateDep, principal: PrincipalDep) -> Reward:
    """Record a reward (see the module docstring for the rules)."""
    if not math.isfinite(body.value):
        raise bad_request(f"value must be a finite number, got {body.value}", "value")
    cap = state.config.gateway.limits.reward_max_abs
    if abs(body.value) > cap:
        raise bad_request(
            f"|value| must be at most {cap:g} (gateway.limits.reward_max_abs), got {body.value:g}",
            "value",
        )
    owner = "" if principal.is_admin else (principal.key_id or "")
    if body.id is not None:
        existing = await asyncio.to_thread(state.store.get_reward, body.id, owner)
        if existing is not None:
            _same_or_conflict(existing, body)
            return await _accepted(state, existing, body)
    session = await _target_session(state, principal, body)
    if session is not None and session.status in _TRAINING:  # cheap early answer
        raise _trained(
            f"session {session.id!r} is already {session.status}; its rewards can no longer change",
            "session_id",
        )
    record = RewardRecord(
        id=body.id or f"rwd_{uuid.uuid4().hex}",
        value=body.value,
        name=body.name,
        completion_id=body.completion_id,
        session_id=body.session_id,
        group_id=body.group_id,
        metadata=body.metadata,
        owner=owner,
    )
    stored = await _accepted(state, record, body)
    # A retry that lost a race to its own id gets the earlier reward back (its own
    # created_at): counted by the post that stored it, not again.
    if stored.id == record.id and stored.created_at == record.created_at:
        await _observe_reward(state, session, body)
    if body.end_session and session is not None and session.status == "open":
        await state.end_session(session.id, "reward")
    return stored


async def _observe_reward(
    state: GatewayState, session: SessionRecord | None, body: RewardCreate
) -> None:
    """`areal_policy_reward{policy}` observes a newly stored reward: under its session's
    policy, or once under each policy of a scored group. Without declared policies every
    session is the default policy's (no query); a group reward with them reads the
    group's policies (one indexed query; group rewards come from the admin only)."""
    if session is not None:
        policies = [session.policy]
    elif body.group_id is None:  # a completion outside a session: no policy trains it
        return
    elif not state.policy_registry.declared:
        policies = [DEFAULT_POLICY]
    else:
        policies = await asyncio.to_thread(state.store.group_policies, body.group_id)
    for policy in policies:
        state.metrics.observe_reward(policy, body.value)


async def _accepted(state: GatewayState, record: RewardRecord, body: RewardCreate) -> Reward:
    """Store `record` (the authoritative state check, `reward_admission.py`); an earlier
    reward of the same id comes back as stored, or 409 if its values differ."""
    try:
        accepted = await asyncio.to_thread(
            state.store.accept_reward, record, additive=body.additive
        )
    except RewardRefused as refused:
        if refused.code == "session_trained":
            raise _trained(refused.message, refused.param) from None
        raise OpenAIError(409, refused.message, param=refused.param, code=refused.code) from None
    _same_or_conflict(accepted.record, body)  # lost a race with the same id
    return Reward.of(accepted.record, accepted.target_total)


def _trained(message: str, param: str) -> OpenAIError:
    return OpenAIError(409, message, param=param, code="session_trained")


def _same_or_conflict(existing: RewardRecord, body: RewardCreate) -> None:
    same = (
        existing.value == body.value
        and existing.name == body.name
        and existing.completion_id == body.completion_id
        and existing.session_id == body.session_id
        and existing.group_id == body.group_id
    )
    if not same:
        raise OpenAIError(
            409,
            f"reward id {existing.id!r} was already used with other values",
            param="id",
            code="reward_id_conflict",
        )
