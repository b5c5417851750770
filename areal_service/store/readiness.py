"""Which ended episodes are ready to claim, and which are still settling their reward.

Read-only queries for `claims.py` (ready groups, rewarded sessions) and the figures the
console and the trainer's metrics show about reward settling (`settling_counts`, through
`TrajectoryStore.settling_counts`). A
session whose client declared that no reward will come ends with reason `no_reward`
(`types.END_NO_REWARD`): it never waits for one.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import cast

from sqlalchemy import Connection, Engine, and_, case, func, or_, select

from areal_service.store.schema import CompletionRow, RewardRow, SessionRow
from areal_service.types import DEFAULT_POLICY, END_FAILED, END_NO_REWARD

UNREWARDED = "unrewarded"
"""Prefix of the `drop_reason` of sessions dropped by `unrewarded_policy=drop_group`."""


@dataclass(frozen=True, slots=True)
class ReadyGroup:
    """A group whose sessions have all ended: `key` is its group_id, or the session id of
    an ungrouped session; `declared` are the sessions that said no reward will come."""

    key: str
    grouped: bool
    session_ids: tuple[str, ...]
    last_ended_at: float
    declared: frozenset[str] = frozenset()
    failed: frozenset[str] = frozenset()
    """Sessions whose agent failed (end reason `failed`): dropped alone, no reward awaited."""
    task_id: str | None = None


def ready_groups(
    connection: Connection,
    group_size: int | None,
    limit: int,
    exclude: set[str],
    *,
    partial_before: float | None = None,
    policy: str = DEFAULT_POLICY,
) -> list[ReadyGroup]:
    """Oldest-first groups whose sessions (not yet claimed/trained/dropped) are all
    `ended`: at least `group_size` of them, or fewer when the group's last session ended
    before `partial_before` (a partial group settles; None: never), and every ungrouped
    session as a group of its own, among `policy`'s sessions only (its trainer's). Two
    indexed queries; `exclude` keys are skipped."""
    solo = case((SessionRow.group_id.is_(None), SessionRow.id), else_=None)
    n_open = func.sum(case((SessionRow.status == "open", 1), else_=0))
    n_ended = func.count() - n_open
    last_end = func.max(SessionRow.ended_at)
    enough = or_(n_ended >= (group_size or 1), SessionRow.group_id.is_(None))
    if partial_before is not None:
        enough = or_(enough, last_end < partial_before)
    statement = (
        select(SessionRow.group_id, solo, last_end)
        .where(SessionRow.status.in_(("open", "ended")), SessionRow.policy == policy)
        .group_by(SessionRow.group_id, solo)
        .having(n_open == 0, enough)
        .order_by(func.min(SessionRow.created_at), SessionRow.group_id, solo)
        .limit(limit + len(exclude))
    )
    heads = [
        (group_id or solo_id, group_id is not None, ended_at)
        for group_id, solo_id, ended_at in connection.execute(statement)
        if (group_id or solo_id) not in exclude
    ][:limit]
    if not heads:
        return []
    grouped = [key for key, is_group, _ in heads if is_group]
    members: dict[str, list[str]] = {key: [] for key, _, _ in heads}
    tasks: dict[str, str | None] = {}
    declared: set[str] = set()
    failed: set[str] = set()
    rows = connection.execute(
        select(SessionRow.id, SessionRow.group_id, SessionRow.end_reason, SessionRow.task_id)
        .where(SessionRow.status == "ended", SessionRow.policy == policy)
        .where(
            or_(
                SessionRow.group_id.in_(grouped),
                SessionRow.id.in_([key for key, is_group, _ in heads if not is_group]),
            )
        )
        .order_by(SessionRow.created_at, SessionRow.id)
    )
    for session_id, group_id, end_reason, task_id in rows:
        members[group_id or session_id].append(session_id)
        tasks.setdefault(group_id or session_id, task_id)
        if end_reason == END_NO_REWARD:
            declared.add(session_id)
        elif end_reason == END_FAILED:
            failed.add(session_id)
    return [
        ReadyGroup(
            key,
            is_group,
            tuple(members[key]),
            ended_at or 0.0,
            frozenset(declared.intersection(members[key])),
            frozenset(failed.intersection(members[key])),
            tasks.get(key),
        )
        for key, is_group, ended_at in heads
        if members[key]
    ]


def rewarded_sessions(engine: Engine, ready: list[ReadyGroup]) -> set[str]:
    """Which sessions of `ready` some reward targets (session, completion or group)."""
    ids = [sid for r in ready for sid in r.session_ids]
    if not ids:
        return set()
    groups = {r.key: r.session_ids for r in ready if r.grouped}
    direct = select(RewardRow.session_id).where(RewardRow.session_id.in_(ids))
    via_completion = (
        select(CompletionRow.session_id)
        .join(RewardRow, RewardRow.completion_id == CompletionRow.id)
        .where(CompletionRow.session_id.in_(ids))
    )
    of_group = select(RewardRow.group_id).where(RewardRow.group_id.in_(list(groups)))
    with engine.connect() as connection:
        # IN drops NULL ids: the nullable columns' Optional does not apply to these rows.
        found = cast("set[str]", set(connection.execute(direct.union(via_completion)).scalars()))
        for group_id in cast("Iterable[str]", connection.execute(of_group).scalars()):
            found.update(groups[group_id])
    return found


@dataclass(frozen=True, slots=True)
class SettlingCounts:
    """Reward settling at a glance (console overview)."""

    awaiting_reward: int
    """Ended sessions no reward targets yet (and that did not declare none is coming)."""
    dropped_unrewarded: int
    """Sessions dropped because their group had an unrewarded session (`drop_group`)."""


def settling_counts(engine: Engine) -> SettlingCounts:
    """Two COUNTs; the first visits only `ended` sessions (few: the trainer claims them),
    each with indexed lookups of its rewards (correlated NOT EXISTS: the rewards table,
    which only grows, is never scanned whole)."""
    rewarded_directly = select(RewardRow.id).where(RewardRow.session_id == SessionRow.id)
    rewarded_via_completion = (
        select(RewardRow.id)
        .join(CompletionRow, RewardRow.completion_id == CompletionRow.id)
        .where(CompletionRow.session_id == SessionRow.id)
    )
    rewarded_group = select(RewardRow.id).where(RewardRow.group_id == SessionRow.group_id)
    awaiting = (
        select(func.count())
        .select_from(SessionRow)
        .where(
            SessionRow.status == "ended",
            or_(
                SessionRow.end_reason.is_(None),
                SessionRow.end_reason.not_in((END_NO_REWARD, END_FAILED)),
            ),
            ~rewarded_directly.exists(),
            ~rewarded_via_completion.exists(),
            or_(SessionRow.group_id.is_(None), ~rewarded_group.exists()),
        )
    )
    dropped = (
        select(func.count())
        .select_from(SessionRow)
        .where(and_(SessionRow.status == "dropped", SessionRow.drop_reason.startswith(UNREWARDED)))
    )
    with engine.connect() as connection:
        return SettlingCounts(
            int(connection.execute(awaiting).scalar_one()),
            int(connection.execute(dropped).scalar_one()),
        )
