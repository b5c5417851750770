"""Named policies at the gateway (`policies:` in config, and those created at runtime):
which policy a key, a session and a request belong to, and creating one. The policy of
a session is fixed when it opens (its key's, or the admin's explicit choice); which
policy serves a request is the serving plan's answer for its principal
(`areal_service/serving_plan.py`): a request's model name picks another policy only for
the admin, or for an episode whose policy declares that policy among its roles.

Every lookup reads `state.policy_registry` (`areal_service/policy_registry.py`), which
`run_policy_refresher` rebuilds from the store off the request path; the request path
itself never queries the store for policies. A name not known yet (created on another
worker since the last refresh) is looked up once more where a policy is chosen (key and
session creation), never while serving."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from areal_service.policy_registry import (
    PolicyError,
    checked_roles,
    deletable,
    deletion_reason,
    matrix_modules,
    new_policy,
)
from areal_service.serving_plan import CallerKind
from areal_service.store import PolicyConflict
from areal_service.types import DEFAULT_POLICY, PolicyRecord
from gateway.errors import OpenAIError
from gateway.roles import role_session
from gateway.sessions import cached_session

if TYPE_CHECKING:
    from gateway.auth import Principal
    from gateway.state import GatewayState

log = logging.getLogger(__name__)

POLICY_REFRESH_S = 1.0
"""How often each gateway process re-reads the runtime policies (one small store read):
a policy created on another worker or replica is served there within about this."""


async def refresh_policies(state: GatewayState) -> list[str]:
    """Re-read the runtime policies from the store when they changed (one aggregate
    query says whether); the names new to this process."""
    mark = await asyncio.to_thread(state.store.policies.policies_mark)
    if mark == state.runtime_policies_seen:
        return []
    records = await asyncio.to_thread(state.store.policies.list_policies)
    state.runtime_policies_seen = mark
    before = set(state.policy_registry.runtime)
    added = state.policy_registry.update(records)
    state.model_policies = state.policy_registry.model_policies
    if added:
        log.info("runtime policies now known: %s", ", ".join(added))
    for name in sorted(before - set(state.policy_registry.runtime)):
        _forget_policy(state, name)
    return added


def _forget_policy(state: GatewayState, name: str) -> None:
    """A runtime policy was deleted (here or by another process): its live version is
    forgotten (a backend that comes back is not re-synced to it) and its adapter is
    unloaded from the engines that unload adapters (vLLM, SGLang: once the requests
    under it ended); the local engine keeps it in memory until it restarts."""
    state.policy_versions.pop(name, None)
    unloading = state.backends.retire_policy(name)
    log.warning(
        "policy %s was deleted: %s",
        name,
        f"its adapter is unloaded from {unloading} backend(s)"
        if unloading
        else "its adapter stays loaded on the local engine until it restarts",
    )


async def run_policy_refresher(state: GatewayState) -> None:
    """Refresh the runtime policies every `POLICY_REFRESH_S` (until cancelled)."""
    while True:
        await asyncio.sleep(POLICY_REFRESH_S)
        try:
            await refresh_policies(state)
        except Exception:  # the store failed this round; the policies known stay
            log.exception("reading the runtime policies failed; retrying")


async def checked_policy(state: GatewayState, name: str | None, *, param: str = "policy") -> str:
    """`name` when it is a policy of this deployment (None: the default policy); else
    400 `unknown_policy` in the OpenAI error shape. A name unknown here is looked up in
    the store once before it is refused (it may be minutes old on another worker)."""
    if name is None:
        return DEFAULT_POLICY
    if name not in state.policy_registry:
        await refresh_policies(state)
    if name not in state.policy_registry:
        raise OpenAIError(
            400,
            f"unknown policy {name!r}; known: {', '.join(state.policy_registry.names())}",
            param=param,
            code="unknown_policy",
        )
    return name


async def create_policy(
    state: GatewayState,
    name: str,
    lora: dict[str, Any] | None = None,
    model_names: Sequence[str] = (),
    roles: Sequence[str] = (),
) -> PolicyRecord:
    """Create a runtime policy (admin API, console): checked against the config and the
    freshly read registry (400/409 in the OpenAI error shape), then stored, where the
    primary keys settle a race with another process creating the same name or model
    name. Known to this process at once, to the others within `POLICY_REFRESH_S`."""
    await refresh_policies(state)
    modules = None
    if lora is not None:  # headers only: a few KB read per creation, off the hot path
        modules = await asyncio.to_thread(matrix_modules, state.config.model_dir())
    try:
        record = new_policy(
            state.config, state.policy_registry, name, lora, model_names, modules, roles
        )
        await asyncio.to_thread(state.store.policies.add_policy, record)
    except PolicyError as exc:
        raise _wire(exc) from None
    except PolicyConflict as exc:
        code = "policy_exists" if exc.field == "name" else "model_name_taken"
        raise OpenAIError(409, f"{exc.field}: {exc}", param=exc.field, code=code) from None
    await refresh_policies(state)
    return record


def _wire(exc: PolicyError) -> OpenAIError:
    return OpenAIError(exc.status, exc.message, param=exc.param, code=exc.code)


async def set_policy_roles(state: GatewayState, name: str, roles: Sequence[str]) -> PolicyRecord:
    """Set runtime policy `name`'s roles (admin API, console): checked as a creation's
    (400 bad roles, 404 unknown, 409 a config-declared policy or `default`); episodes
    open the new roles from the next refresh on (here at once)."""
    await refresh_policies(state)
    try:
        record = checked_roles(state.config, state.policy_registry, name, roles)
    except PolicyError as exc:
        raise _wire(exc) from None
    if not await asyncio.to_thread(state.store.policies.set_roles, name, record.roles):
        raise OpenAIError(404, f"no policy {name!r}", param="name", code="policy_not_found")
    await refresh_policies(state)
    return record


async def delete_policy(state: GatewayState, name: str) -> int:
    """Delete runtime policy `name` (admin API, console): refused for `default`, a
    config-declared policy and one another policy declares as a role (409, saying why),
    404 for an unknown one. Its sessions not yet trained are dropped with the reason
    `policy_deleted: ...` in the same transaction; what they recorded stays for export.
    Returns how many were dropped. Its adapter is unloaded at the refresh that follows
    (`_forget_policy`, here at once, on other processes within `POLICY_REFRESH_S`); its
    trainer stops (the launcher stops those it started, any other notices by itself)."""
    await refresh_policies(state)
    try:
        deletable(state.config, state.policy_registry, name)
    except PolicyError as exc:
        raise _wire(exc) from None
    reason = deletion_reason(name)
    dropped = await asyncio.to_thread(state.store.policies.delete_policy, name, reason)
    if dropped is None:
        raise OpenAIError(404, f"no policy {name!r}", param="name", code="policy_not_found")
    await refresh_policies(state)
    log.warning("policy %s deleted: %d session(s) not trained were dropped", name, dropped)
    return dropped


async def check_key_policy(state: GatewayState, policy: str) -> None:
    """A key bound to `policy` may be used only while `policy` exists: 403
    `policy_deleted` once the admin deleted it (a name unknown here is looked up in the
    store once first: it may have been created on another process since the last
    refresh). A dict lookup on the request path otherwise."""
    if policy in state.policy_registry:
        return
    await refresh_policies(state)
    if policy not in state.policy_registry:
        raise OpenAIError(
            403,
            f"this key is bound to policy {policy!r}, which was deleted by the admin: it "
            "serves and records nothing; ask the admin for a key of another policy",
            param="policy",
            code="policy_deleted",
        )


async def serving_policy(
    state: GatewayState, principal: Principal, session_id: str | None, model: str
) -> tuple[str | None, str | None]:
    """(adapter, session): the adapter name a request's generations run under (None for
    the default policy: the backend's own default, the local engine's default adapter or
    vLLM's `ADAPTER_NAME`; else the policy's name), and the session its completions are
    recorded in. The serving plan decides the policy from the principal
    (`ServingPlan.serving`): a key is served by its own policy whatever model name it
    sends; the admin by its session's (else the default), or by the policy whose alias it
    names; an episode's session key by the role its policy declares under that alias. A
    policy other than the session's is a role of the episode: the completions go to its
    role sub-session (`gateway/roles.py`), which that policy trains. Called only with
    declared policies; a key costs no store read (its policy is on the key), the admin's
    session one cached lookup."""
    key = principal.key
    own = DEFAULT_POLICY
    caller: CallerKind = "admin"
    if key is not None:
        caller, own = ("session" if key.kind == "session" else "user"), key.policy
    elif session_id is not None:
        session = await cached_session(state, session_id)
        own = DEFAULT_POLICY if session is None else session.policy
    policy, role = state.policy_registry.plan.serving(caller, own, model)
    # A request may name a role sub-session itself (its key owns it, and its ids alone
    # hold a `~`): its completions under the episode's policy go to the episode.
    if session_id is not None and (role or "~" in session_id):
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
