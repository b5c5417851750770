"""Named policies at the gateway (`policies:` in config): which policy a key, a session
and a request belong to. The policy of a session is fixed when it opens (its key's, or
the admin's explicit choice); a request's model name may pick another policy only
through a policy's declared `model_names`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from areal_service.config import ServiceConfig
from areal_service.types import DEFAULT_POLICY
from gateway.errors import OpenAIError
from gateway.sessions import cached_session

if TYPE_CHECKING:
    from gateway.auth import Principal
    from gateway.state import GatewayState


def checked_policy(config: ServiceConfig, name: str | None) -> str:
    """`name` when it is a policy of `config` (None: the default policy); else 400
    `unknown_policy` in the OpenAI error shape."""
    if name is None:
        return DEFAULT_POLICY
    known = config.policy_names()
    if name not in known:
        raise OpenAIError(
            400,
            f"unknown policy {name!r}; known: {', '.join(known)}",
            param="policy",
            code="unknown_policy",
        )
    return name


async def serving_adapter(
    state: GatewayState, principal: Principal, session_id: str | None, model: str
) -> str | None:
    """The adapter name a request's generations run under: None for the default policy
    (the backend's own default: the local engine's default adapter, vLLM's
    `ADAPTER_NAME`), else the policy's name. A model name declared in a policy's
    `model_names` picks that policy; any other name the caller's: its key's (a key's
    sessions share its policy), or for the admin key its session's. Without declared
    policies this is one attribute test per request."""
    if not state.config.policies:
        return None
    policy = state.model_policies.get(model)
    if policy is None:
        if principal.key is not None:
            policy = principal.key.policy
        elif session_id is not None:
            session = await cached_session(state, session_id)
            policy = DEFAULT_POLICY if session is None else session.policy
        else:
            policy = DEFAULT_POLICY
    return None if policy == DEFAULT_POLICY else policy
