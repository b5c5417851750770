"""`POST /v1/rewards`: a named score on a completion, a session (episode) or a group.

Idempotent by a client-chosen `id`, scoped to the posting key (a retried post is a
no-op; the same id with other values is a 409; another key's ids are invisible). 404 for
an unknown target; 409 `session_trained` once the session, or any session of the scored
group, was claimed for training (checked in the insert's transaction, so no reward is
acknowledged and then missed by a claim); 409 `reward_exists` for a second reward of the
same `name` on the same target unless the body says `additive: true` (rewards on one
target add up); 400 for a non-finite value or one beyond `gateway.limits.reward_max_abs`.
Session keys may score only their own session. The reply's `target_total` is the sum of
every reward now on the target. A multi-agent episode's reward and its roles' rewards are
stored in one transaction: a 409 for any of them leaves none committed (the session stays
as it was, and a corrected retry of the same id succeeds).

Returns stay finite by construction: a return sums at most every reward of a session and
its group, each bounded by the cap (default 1e6), and n * cap cannot overflow a float for
any realistic n (past 1e302 rewards at the default). A per-reward bound costs nothing per
post and holds under concurrent posts, where a check summing the session's rewards so far
would read them all on every post and could pass two racing posts that overflow together.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import uuid
from typing import Any, Literal

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field, model_validator

from areal_service.store.reward_admission import RewardRefused
from areal_service.types import DEFAULT_POLICY, RewardRecord, SessionRecord
from gateway.auth import Principal
from gateway.deps import PrincipalDep, StateDep
from gateway.errors import ErrorBody, OpenAIError, bad_request
from gateway.policies import checked_policy
from gateway.routes.views import record_view
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
    role_rewards: dict[str, float] | None = Field(None, max_length=64)
    """Multi-agent episodes (`session_id` only): role (policy) -> the value its role
    sub-session gets instead of `value`. `value` is the episode's reward: its own
    session's, and every role's not named here."""

    @model_validator(mode="after")
    def _one_target(self) -> RewardCreate:
        targets = [t for t in (self.completion_id, self.session_id, self.group_id) if t]
        if len(targets) != 1:
            raise ValueError("name exactly one target: completion_id, session_id or group_id")
        if self.role_rewards is not None and self.session_id is None:
            raise ValueError("role_rewards go with a session_id (the episode's session)")
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
    roles: dict[str, float] = Field(default_factory=dict)
    """Multi-agent episodes: each role sub-session the reward reached (role -> value).
    Empty for an episode of one policy."""

    @classmethod
    def of(cls, r: RewardRecord, target_total: float) -> Reward:
        return record_view(cls, r, target_total=target_total)


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


def _check_value(state: GatewayState, value: float, param: str) -> None:
    """400 for a non-finite value or one beyond `gateway.limits.reward_max_abs`."""
    if not math.isfinite(value):
        raise bad_request(f"{param} must be a finite number, got {value}", param)
    cap = state.config.gateway.limits.reward_max_abs
    if abs(value) > cap:
        raise bad_request(
            f"|{param}| must be at most {cap:g} (gateway.limits.reward_max_abs), got {value:g}",
            param,
        )


@router.post("/v1/rewards", status_code=201)
@router.post("/rewards", status_code=201, include_in_schema=False)
async def post_reward(body: RewardCreate, state: StateDep, principal: PrincipalDep) -> Reward:
    """Record a reward (see the module docstring for the rules)."""
    _check_value(state, body.value, "value")
    for role, value in (body.role_rewards or {}).items():
        await checked_policy(state, role, param="role_rewards")
        _check_value(state, value, f"role_rewards.{role}")
    owner = "" if principal.is_admin else (principal.key_id or "")
    if body.id is not None:
        existing = await asyncio.to_thread(state.store.get_reward, body.id, owner)
        if existing is not None:
            _same_or_conflict(existing, body)
            # A retry also gives its reward to roles opened since the first post.
            roles = await _retried_roles(state, principal, body, existing)
            return (await _store_with_roles(state, body, existing, roles))[0]
    session = await _target_session(state, principal, body)
    if session is not None and session.status in _TRAINING:  # cheap early answer
        raise _trained(
            f"session {session.id!r} is already {session.status}; its rewards can no longer change",
            "session_id",
        )
    roles = await _episode_roles(state, body, session)
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
    replied, new = await _store_with_roles(state, body, record, roles)
    # A retry that lost a race to its own id gets the earlier reward back (its own
    # created_at): counted by the post that stored it, not again.
    if new:
        await _observe_reward(state, session, body)
    if body.end_session and session is not None and session.status == "open":
        await state.end_session(session.id, "reward")  # its roles end with it
    return replied


async def _episode_roles(
    state: GatewayState, body: RewardCreate, session: SessionRecord | None, *, retry: bool = False
) -> list[SessionRecord]:
    """The role sub-sessions a session reward reaches: every role of the episode when
    the target is an episode's own session (none without declared policies: no store
    read), after the checks that must pass before anything is stored: `role_rewards`
    names no role the episode lacks, and (unless `retry`: a retried post's role rewards
    are already stored and come back as they are) no role is already claimed."""
    if not state.policy_registry.declared or body.session_id is None or session is None:
        return []
    if session.parent_session_id is not None:
        if body.role_rewards:
            raise bad_request(
                f"session {session.id!r} is a role of episode "
                f"{session.parent_session_id!r}; post role_rewards on the episode's session",
                "role_rewards",
                "role_session",
            )
        return []
    roles = await asyncio.to_thread(
        state.store.list_sessions, parent_session_id=session.id, limit=1000
    )
    named = set(body.role_rewards or {})
    missing = named - {r.policy for r in roles}
    if missing:
        raise bad_request(
            f"episode {session.id!r} has no role {sorted(missing)[0]!r} (its roles: "
            f"{', '.join(sorted(r.policy for r in roles)) or 'none'}; the episode's own "
            f"policy {session.policy!r} takes `value`)",
            "role_rewards",
            "unknown_role",
        )
    for role in [] if retry else roles:
        if role.status in _TRAINING:
            raise _trained(
                f"role {role.policy!r} of session {session.id!r} is already {role.status}; "
                "its rewards can no longer change",
                "session_id",
            )
    return roles


async def _retried_roles(
    state: GatewayState, principal: Principal, body: RewardCreate, existing: RewardRecord
) -> list[SessionRecord]:
    """The roles a retried episode reward reaches (none but for a session reward under
    declared policies)."""
    if existing.session_id is None or not state.policy_registry.declared:
        return []
    session = await load_session(state, existing.session_id)
    check_session_access(principal, session)
    return await _episode_roles(state, body, session, retry=True)


async def _store_with_roles(
    state: GatewayState, body: RewardCreate, record: RewardRecord, roles: list[SessionRecord]
) -> tuple[Reward, bool]:
    """`record` and, for each role sub-session, its own reward (id `<id>~<role>`;
    `role_rewards` overrides the value) stored in one transaction: all or, on a 409,
    none. The reply, and whether `record` was newly stored."""
    overrides = body.role_rewards or {}
    role_records = [
        dataclasses.replace(
            record,
            id=f"{record.id}~{role.policy}",
            value=overrides.get(role.policy, record.value),
            session_id=role.id,
            metadata={**record.metadata, "episode_reward": record.id},
        )
        for role in roles
    ]
    try:
        accepted = await asyncio.to_thread(
            state.store.accept_rewards, [record, *role_records], additive=body.additive
        )
    except RewardRefused as refused:
        raise _refusal(refused) from None
    episode = accepted[0].record
    given: dict[str, float] = {}
    for role, wanted, got in zip(roles, role_records, accepted[1:], strict=True):
        if got.record.created_at == wanted.created_at:  # newly stored: counted once
            state.metrics.observe_reward(role.policy, wanted.value)
        given[role.policy] = wanted.value
    reply = Reward.of(episode, accepted[0].target_total)
    new = episode.created_at == record.created_at
    return (reply.model_copy(update={"roles": given}) if given else reply), new


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


def _refusal(refused: RewardRefused) -> OpenAIError:
    """A store refusal as its 409 (`session_trained`, `reward_exists`,
    `reward_id_conflict`)."""
    if refused.code == "session_trained":
        return _trained(refused.message, refused.param)
    return OpenAIError(409, refused.message, param=refused.param, code=refused.code)


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
