"""Who may add a session to a GRPO group, checked and inserted in one transaction.

A user key may name a group for itself (its refreshes join it); the admin's sessions must
not land in a group a user key's session holds (its rewards would enter their advantages),
and a user key must not join a group that holds any other key's session. Checked in one
statement and inserted in another transaction, two racing refreshes into one new group id
both pass (the audit's N5: 5 of 20 raced groups held two keys' sessions). So the check
runs in the insert's transaction after a per-group lock: PostgreSQL, a transaction-scoped
advisory lock on the group id's hash (a collision only serialises two groups' inserts);
SQLite, the database write lock, taken by a first statement that writes, so the read that
follows sees the newest commit and no other writer commits before this one.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Connection, func, or_, select, update

from areal_service.store.schema import ApiKeyRow, SessionRow

GROUP_LOCK_CLASS = 0x4152_4547
"""First key of the PostgreSQL advisory lock of a group ("AREG"); the second is the
hash of the group id."""


@dataclass(frozen=True, slots=True)
class GroupRule:
    """Who may add a session to its group: `owner` set, a user key's refresh (every
    session already in the group must be that key's); None, the admin (no session in the
    group may be a user key's)."""

    owner: str | None


class GroupRefused(Exception):
    """The session was not inserted: `code` is `group_not_owned` (a user key naming a
    group that holds another key's session) or `group_in_use` (the admin naming a group a
    user key's session holds)."""

    def __init__(self, code: str, group_id: str) -> None:
        super().__init__(f"{code}: {group_id}")
        self.code = code
        self.group_id = group_id


def group_refusal(connection: Connection, group_id: str, rule: GroupRule) -> GroupRefused | None:
    """Why `rule` may not add a session to `group_id` now, or None (one indexed read)."""
    in_group = select(SessionRow.id).where(SessionRow.group_id == group_id).limit(1)
    if rule.owner is not None:
        other = in_group.where(
            or_(SessionRow.api_key_id.is_(None), SessionRow.api_key_id != rule.owner)
        )
        if connection.execute(other).first() is not None:
            return GroupRefused("group_not_owned", group_id)
        return None
    users = in_group.join(ApiKeyRow, ApiKeyRow.id == SessionRow.api_key_id).where(
        ApiKeyRow.kind == "user"
    )
    if connection.execute(users).first() is not None:
        return GroupRefused("group_in_use", group_id)
    return None


def lock_group(connection: Connection, group_id: str) -> None:
    """Hold `group_id`'s insert lock until the transaction ends (module docstring)."""
    if connection.dialect.name == "postgresql":
        connection.execute(
            select(func.pg_advisory_xact_lock(GROUP_LOCK_CLASS, func.hashtext(group_id)))
        )
    else:  # a write (even of no row) takes SQLite's write lock
        connection.execute(
            update(SessionRow)
            .where(SessionRow.group_id == group_id)
            .values(last_activity_at=SessionRow.last_activity_at)
        )
