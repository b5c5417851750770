"""Episode reads: the completions and rewards of many sessions, one query each whatever
their number; read-only. Called through `TrajectoryStore.load_completions` and
`load_rewards` (claiming, export, the console's session page, the gateway's session
status).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from sqlalchemy import Engine, or_, select

from areal_service.store.rows import completion_from_row, record_from_row
from areal_service.store.schema import CompletionRow, RewardRow
from areal_service.types import CompletionRecord, RewardRecord


def load_completions(
    engine: Engine, session_ids: Sequence[str], *, with_json: bool = True
) -> dict[str, list[CompletionRecord]]:
    """The completions of each session, oldest first (every given id is a key).
    `with_json=False` leaves request_json/response_json empty: the trainer needs only
    the arrays, and messages can be most of a row."""
    found: dict[str, list[CompletionRecord]] = {sid: [] for sid in session_ids}
    if not found:
        return found
    skipped: dict[str, object] = {} if with_json else {"request_json": {}, "response_json": {}}
    columns = [c for c in CompletionRow.__table__.c if c.name not in skipped]
    statement = (
        select(*columns)
        .where(CompletionRow.session_id.in_(list(found)))
        .order_by(CompletionRow.created_at, CompletionRow.id)
    )
    with engine.connect() as connection:
        for row in connection.execute(statement):
            found[row.session_id].append(completion_from_row(row, **skipped))
    return found


def load_rewards(
    engine: Engine, session_ids: Sequence[str], group_ids: Iterable[str] = ()
) -> list[RewardRecord]:
    """Every reward on these sessions, on their completions or on these groups, oldest
    first; `episodes.compute_returns` attributes each to its session."""
    groups = sorted(set(group_ids))
    if not session_ids and not groups:
        return []
    of_sessions = select(CompletionRow.id).where(CompletionRow.session_id.in_(list(session_ids)))
    statement = (
        select(RewardRow)
        .where(
            or_(
                RewardRow.session_id.in_(list(session_ids)),
                RewardRow.completion_id.in_(of_sessions),
                RewardRow.group_id.in_(groups),
            )
        )
        .order_by(RewardRow.created_at, RewardRow.id)
    )
    with engine.connect() as connection:
        return [record_from_row(RewardRecord, row) for row in connection.execute(statement)]
