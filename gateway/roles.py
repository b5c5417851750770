"""Role sub-sessions: one multi-agent episode served by several policies.

A completion served under a policy other than its episode's (a request whose model name
is declared in another policy's `model_names`) is recorded in a *role sub-session* of
the episode: a session of that policy (the role) with the episode's key, group and task,
linked by `parent_session_id`, opened on the role's first completion under the derived
id `role_session_id(episode, policy)`. Each policy's trainer then claims its own
sessions as for any episode: GRPO groups stay per policy (the role sub-sessions of one
group id form that policy's group), and each sub-session ends trained or dropped with a
reason like any session. The episode's end ends its roles (`TrajectoryStore.end_session`,
the idle sweep); its reward reaches them through `/v1/rewards` (`routes/rewards.py`).

Cost: nothing for a request served under its episode's own policy; the first completion
of a role opens it (one insert), later ones find it in the session cache.
"""

from __future__ import annotations

import asyncio

from areal_service.types import SessionRecord, role_session_id
from gateway.errors import OpenAIError
from gateway.sessions import cached_session, remember_new_session
from gateway.state import GatewayState


async def role_session(state: GatewayState, episode: SessionRecord, policy: str) -> str:
    """The id of `episode`'s open role sub-session under `policy`, opened on first use;
    409 `session_closed` once the episode (and so the role) has ended.

    A role is not put through the staleness gate: its episode was admitted whole, and an
    episode must not wait (or fail with a 429) halfway through its turns."""
    role_id = role_session_id(episode.id, policy)
    role = await cached_session(state, role_id)
    if role is None:
        if episode.status != "open":
            raise _closed(episode.id, episode.status)
        record = SessionRecord(
            id=role_id,
            group_id=episode.group_id,
            task_id=episode.task_id,
            api_key_id=episode.api_key_id,
            metadata={"opened_by": "role", "role": policy},
            policy=policy,
            parent_session_id=episode.id,
        )
        try:
            role = await asyncio.to_thread(state.store.add_session, record)
        except Exception:  # a concurrent first completion of the role inserted it first
            role = await asyncio.to_thread(state.store.get_session, role_id)
            if role is None:
                raise
        remember_new_session(state, role)
    if role.status != "open":
        raise _closed(episode.id, role.status)
    return role_id


def _closed(episode_id: str, status: str) -> OpenAIError:
    return OpenAIError(
        409,
        f"session {episode_id!r} is {status}; start a new one",
        param="session_id",
        code="session_closed",
    )
