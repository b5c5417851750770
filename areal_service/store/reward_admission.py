"""Accepting a reward: its target's state checked and the row inserted in one transaction.

Why one transaction: a claim (`claims.py`) reads an episode's rewards once, right after
it moved the sessions to `claimed`. A reward checked against `ended` in one statement and
inserted in another can land after that read: it was acknowledged (201) but never
trained, or its group was dropped as unrewarded. Here the target's session rows are
locked first (PostgreSQL: row locks, which the claimer's `FOR UPDATE SKIP LOCKED` skips
and its UPDATE waits for; SQLite: the database write lock, so the status read that
follows sees the newest commit), then their status is read and the reward inserted
before the locks go. Either the reward commits first and the claim that follows sees it,
or the claim commits first and the reward is refused.

A second reward on a target that already has one with the same `name` is refused too,
unless the client marks it additive: rewards on one target add up (a judge's `correct`
plus a `format` bonus), and a silent 1 -> 1.5 from a retried or double-posted score is
the more likely mistake. The caller sees the target's total after the insert.

A multi-agent episode's reward and its roles' rewards (`accept_rewards`) are checked and
inserted in one transaction too: one refused (a role claimed meanwhile, a role that
already has a reward of that name, an id used with other values) refuses them all, so a
409 leaves nothing committed and a corrected retry can succeed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import Connection, Engine, func, select, update
from sqlalchemy.exc import IntegrityError

from areal_service.store.rows import record_from_row, row_values
from areal_service.store.schema import CompletionRow, RewardRow, SessionRow
from areal_service.types import RewardRecord

OPEN_TO_REWARDS = ("open", "ended")
"""Session states a reward may still change; `claimed`, `trained` and `dropped` are final
for the trainer."""


class RewardRefused(Exception):
    """The reward was not stored: `code` is `session_trained` (the target is claimed,
    trained or dropped), `reward_exists` (same name on the same target) or
    `reward_id_conflict` (its id was stored with other values)."""

    def __init__(self, code: str, message: str, param: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param


@dataclass(frozen=True, slots=True)
class AcceptedReward:
    """The stored reward (the earlier one when its id was posted before) and the sum of
    every reward now on its target (completion, session or group)."""

    record: RewardRecord
    target_total: float


def _target_filter(record: RewardRecord) -> tuple[str, str]:
    if record.completion_id is not None:
        return "completion_id", record.completion_id
    if record.session_id is not None:
        return "session_id", record.session_id
    return "group_id", record.group_id or ""


def _target_sessions(connection: Connection, record: RewardRecord) -> Sequence[str]:
    if record.completion_id is not None:
        sid = connection.execute(
            select(CompletionRow.session_id).where(CompletionRow.id == record.completion_id)
        ).scalar_one_or_none()
        return [] if sid is None else [sid]
    if record.session_id is not None:
        return [record.session_id]
    return list(
        connection.execute(
            select(SessionRow.id).where(SessionRow.group_id == record.group_id)
        ).scalars()
    )


def _total(connection: Connection, record: RewardRecord) -> float:
    column, value = _target_filter(record)
    total = connection.execute(
        select(func.sum(RewardRow.value)).where(getattr(RewardRow, column) == value)
    ).scalar_one()
    return float(total or 0.0)


def accept_reward(
    engine: Engine, record: RewardRecord, *, additive: bool = False
) -> AcceptedReward:
    """Insert `record` if its target's sessions are all `open`/`ended` and (unless
    `additive`) no reward of the same name is on the same target; RewardRefused
    otherwise. A reward whose (owner, id) exists is returned as stored (idempotent
    retries; RewardRefused `reward_id_conflict` when its values differ). IntegrityError
    when the named completion or session does not exist."""
    return accept_rewards(engine, [record], additive=additive)[0]


def accept_rewards(
    engine: Engine, records: Sequence[RewardRecord], *, additive: bool = False
) -> list[AcceptedReward]:
    """`accept_reward` for each of `records` in one transaction: all stored (or found
    stored) or, on the first RewardRefused, none (module docstring)."""
    try:
        with engine.begin() as connection:
            stored = [
                _stored(connection, r) or _check_and_insert(connection, r, additive)
                for r in records
            ]
            return [AcceptedReward(r, _total(connection, r)) for r in stored]
    except IntegrityError:
        # A concurrent post of the same ids won (return its rows), or a foreign key failed.
        with engine.connect() as connection:
            winners = [_stored(connection, r) for r in records]
            if any(w is None for w in winners):
                raise
            return [AcceptedReward(w, _total(connection, w)) for w in winners if w is not None]


def _stored(connection: Connection, record: RewardRecord) -> RewardRecord | None:
    """The reward stored under `record`'s (owner, id), or None; RewardRefused when it
    holds other values than `record` (a retry must say the same thing)."""
    table = RewardRow.__table__
    row = connection.execute(
        select(table).where(table.c.id == record.id, table.c.owner == record.owner)
    ).first()
    if row is None:
        return None
    stored = record_from_row(RewardRecord, row)
    fields = ("value", "name", "completion_id", "session_id", "group_id")
    if any(getattr(stored, f) != getattr(record, f) for f in fields):
        raise RewardRefused(
            "reward_id_conflict",
            f"reward id {record.id!r} was already used with other values",
            "id",
        )
    return stored


def _check_and_insert(connection: Connection, record: RewardRecord, additive: bool) -> RewardRecord:
    sessions = _target_sessions(connection, record)
    if sessions:
        # The lock (module docstring). PostgreSQL: FOR NO KEY UPDATE in id order (two
        # group rewards never deadlock; completion inserts' foreign-key KEY SHARE locks
        # do not conflict). SQLite: a no-op UPDATE takes the database write lock.
        if connection.dialect.name == "postgresql":
            connection.execute(
                select(SessionRow.id)
                .where(SessionRow.id.in_(sessions))
                .order_by(SessionRow.id)
                .with_for_update(key_share=True)
            )
        else:
            connection.execute(
                update(SessionRow)
                .where(SessionRow.id.in_(sessions))
                .values(last_activity_at=SessionRow.last_activity_at)
            )
        final = connection.execute(
            select(SessionRow.id, SessionRow.status).where(
                SessionRow.id.in_(sessions), SessionRow.status.not_in(OPEN_TO_REWARDS)
            )
        ).first()
        if final is not None:
            column, value = _target_filter(record)
            what = (
                f"group {value!r}: its session {final.id!r}"
                if column == "group_id"
                else f"session {final.id!r}"
            )
            raise RewardRefused(
                "session_trained",
                f"{what} is already {final.status}; its rewards can no longer change "
                "(the trainer reads an episode's rewards when it claims it)",
                column,
            )
    if not additive:
        column, value = _target_filter(record)
        same = connection.execute(
            select(RewardRow.id, RewardRow.value)
            .where(getattr(RewardRow, column) == value, RewardRow.name == record.name)
            .limit(1)
        ).first()
        if same is not None:
            raise RewardRefused(
                "reward_exists",
                f"{column.removesuffix('_id')} {value!r} already has a reward named "
                f"{record.name!r} ({same.value:g}, id {same.id!r}); rewards on one target "
                'add up: post with "additive": true to add this one, or give it another '
                "name",
                "name",
            )
    values = row_values(record)
    values["metadata"] = values.pop("meta")
    connection.execute(RewardRow.__table__.insert().values(**values))
    return record
