"""Named policies at the gateway (`policies:` in config): which policy a key, a session
and a request belong to. The policy of a session is fixed when it opens (its key's, or
the admin's explicit choice); a request's model name may pick another policy only
through a policy's declared `model_names`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from areal_service.config import ServiceConfig
from areal_service.types import DEFAULT_POLICY
from gateway.errors import OpenAIError
from gateway.roles import role_session
from gateway.sessions import cached_session

if TYPE_CHECKING:
    from gateway.auth import Principal
    from gateway.state import GatewayState


def checked_policy(config: ServiceConfig, name: str | None, *, param: str = "policy") -> str:
    """`name` when it is a policy of `config` (None: the default policy); else 400
    `unknown_policy` in the OpenAI error shape."""
    if name is None:
        return DEFAULT_POLICY
    known = config.policy_names()
    if name not in known:
        raise OpenAIError(
            400,
            f"unknown policy {name!r}; known: {', '.join(known)}",
            param=param,
            code="unknown_policy",
        )
    return name


async def serving_policy(
    state: GatewayState, principal: Principal, session_id: str | None, model: str
) -> tuple[str | None, str | None]:
    """(adapter, session): the adapter name a request's generations run under (None for
    the default policy: the backend's own default, the local engine's default adapter or
    vLLM's `ADAPTER_NAME`; else the policy's name), and the session its completions are
    recorded in. A model name declared in a policy's `model_names` picks that policy; any
    other name the caller's: its key's (a key's sessions share its policy), or for the
    admin key its session's. A picked policy other than the session's is a role of the
    episode: the completions go to its role sub-session (`gateway/roles.py`), which that
    policy trains. Roles are opened only in episodes the admin started (the admin key,
    or a session key it minted): a tenant's user key must not put episodes into another
    tenant's policy, so its completions stay in its own session, as before roles
    existed. Called only with declared policies; an unaliased name costs no store
    read (a key's policy is on the key, a session's is cached)."""
    policy = state.model_policies.get(model)
    if policy is None:
        if principal.key is not None:
            policy = principal.key.policy
        elif session_id is not None:
            session = await cached_session(state, session_id)
            policy = DEFAULT_POLICY if session is None else session.policy
        else:
            policy = DEFAULT_POLICY
    elif session_id is not None and (principal.key is None or principal.key.kind == "session"):
        session_id = await _recorded_in(state, session_id, policy)
    return (None if policy == DEFAULT_POLICY else policy), session_id


async def _recorded_in(state: GatewayState, session_id: str, policy: str) -> str:
    """The session a completion served under `policy` within session `session_id` goes
    to: that session when it is `policy`'s, else the episode's role sub-session. A
    request may name a role sub-session itself (its key owns it): its episode is the
    parent's."""
    session = await cached_session(state, session_id)
    if session is None or session.policy == policy:
        return session_id
    if session.parent_session_id is not None:
        episode = await cached_session(state, session.parent_session_id)
        if episode is None:
            return session_id
        if episode.policy == policy:
            return episode.id
        session = episode
    return await role_session(state, session, policy)
