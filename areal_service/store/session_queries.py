"""Session listings for the pages that read many sessions at once: the export's keyset
pages (oldest first, no OFFSET scan) and the console's sessions table (newest first,
with turn, token and reward figures in one query each). Read-only; called through
`TrajectoryStore.sessions_after` and `session_summaries`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, and_, func, or_, select
from sqlalchemy.sql import Select

from areal_service.store.rows import paged, record_from_row, where_equal
from areal_service.store.schema import CompletionRow, RewardRow, SessionRow
from areal_service.types import SessionRecord, SessionStatus


@dataclass(frozen=True, slots=True)
class SessionQuery:
    """Which sessions (every given condition must hold; None means any)."""

    statuses: tuple[SessionStatus, ...] | None = None
    group_id: str | None = None
    task_id: str | None = None
    api_key_id: str | None = None
    created_from: float | None = None
    """Only sessions created at or after this time (epoch seconds)."""
    created_before: float | None = None
    """Only sessions created before this time."""

    def where(self, statement: Select[Any]) -> Select[Any]:
        """`statement` restricted to these sessions."""
        if self.statuses is not None:
            statement = statement.where(SessionRow.status.in_(self.statuses))
        statement = where_equal(
            statement,
            (SessionRow.group_id, self.group_id),
            (SessionRow.task_id, self.task_id),
            (SessionRow.api_key_id, self.api_key_id),
        )
        if self.created_from is not None:
            statement = statement.where(SessionRow.created_at >= self.created_from)
        if self.created_before is not None:
            statement = statement.where(SessionRow.created_at < self.created_before)
        return statement


def sessions_after(
    engine: Engine, query: SessionQuery, after: tuple[float, str] | None, limit: int
) -> list[SessionRecord]:
    """The next `limit` sessions after the (created_at, id) key `after`, oldest first
    (keyset paging: the cost of a page does not grow with its position)."""
    statement = query.where(select(SessionRow)).order_by(SessionRow.created_at, SessionRow.id)
    if after is not None:
        at, last_id = after
        tie = and_(SessionRow.created_at == at, SessionRow.id > last_id)
        statement = statement.where(or_(SessionRow.created_at > at, tie))
    with engine.connect() as connection:
        rows = connection.execute(statement.limit(limit))
        return [record_from_row(SessionRecord, row) for row in rows]


@dataclass(frozen=True, slots=True)
class SessionSummary:
    """One line of the console's sessions table."""

    session: SessionRecord
    turns: int
    output_tokens: int
    reward: float | None
    """Sum of the rewards on the session and its completions (group rewards excluded);
    None when there is none."""
    drop_reason: str | None = None
    """Why a `dropped` session was dropped (e.g. `unrewarded: ...`, `stale: ...`)."""


def session_summaries(
    engine: Engine, query: SessionQuery, *, limit: int, offset: int
) -> tuple[int, list[SessionSummary]]:
    """(how many sessions match, one page of them newest first with their figures)."""
    listing = paged(
        query.where(select(SessionRow)).order_by(SessionRow.created_at.desc(), SessionRow.id),
        limit,
        offset,
    )
    counting = query.where(select(func.count()).select_from(SessionRow))
    with engine.connect() as connection:
        total = int(connection.execute(counting).scalar_one())
        rows = list(connection.execute(listing))
    sessions = [record_from_row(SessionRecord, row) for row in rows]
    ids = [s.id for s in sessions]
    if not ids:
        return total, []
    per_session = (
        select(CompletionRow.session_id, func.count(), func.sum(CompletionRow.completion_tokens))
        .where(CompletionRow.session_id.in_(ids))
        .group_by(CompletionRow.session_id)
    )
    of_completions = select(CompletionRow.id).where(CompletionRow.session_id.in_(ids))
    reward_rows = (
        select(func.coalesce(RewardRow.session_id, CompletionRow.session_id), RewardRow.value)
        .outerjoin(CompletionRow, CompletionRow.id == RewardRow.completion_id)
        .where(RewardRow.session_id.in_(ids) | RewardRow.completion_id.in_(of_completions))
    )
    rewards: dict[str, float] = {}
    with engine.connect() as connection:
        turns = {sid: (n, int(tokens or 0)) for sid, n, tokens in connection.execute(per_session)}
        for sid, value in connection.execute(reward_rows):
            rewards[sid] = rewards.get(sid, 0.0) + value
    return total, [
        SessionSummary(s, *turns.get(s.id, (0, 0)), rewards.get(s.id), s.drop_reason)
        for s in sessions
    ]
