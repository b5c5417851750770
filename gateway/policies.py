"""Named policies at the gateway (`policies:` in config): which policy a key, a session
and a request belong to. The policy of a session is fixed when it opens (its key's, or
the admin's explicit choice); a request's model name may pick another policy only
through a policy's declared `model_names`."""

from __future__ import annotations

from areal_service.config import ServiceConfig
from areal_service.types import DEFAULT_POLICY
from gateway.errors import OpenAIError


def checked_policy(config: ServiceConfig, name: str | None) -> str:
    """`name` when it is a policy of `config` (None: the default policy); else 400
    `unknown_policy` in the OpenAI error shape."""
    if name is None:
        return DEFAULT_POLICY
    known = config.policy_names()
    if name not in known:
        raise OpenAIError(400, f"unknown policy {name!r}; known: {', '.join(known)}",
                          param="policy", code="unknown_policy")
    return name


def model_name_policies(config: ServiceConfig) -> dict[str, str]:
    """Request model name -> policy, from the policies' `model_names` (built once per
    app: the request path does one dict lookup)."""
    return {alias: p.name for p in config.policies for alias in p.model_names}
