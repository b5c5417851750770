"""Where every episode is: the session count per state, why the dropped were dropped, and
how many no rule will ever move (`unaccounted`, which must stay 0).

A session is accounted for when it is in flight (`open`; `ended` and waiting for its
reward, its group or a trainer; `claimed`), or ended for good: `trained`, or `dropped`
with a reason. Unaccounted: a `dropped` session without a reason, a status the claim
state machine does not know, and an `ended` session whose group can never be claimed
(none of its sessions open, fewer than `group_size` ended, and partial groups never
settle: `trainer.partial_group_wait_s` None). `overdue` counts ended sessions that could
be claimed but have waited past every settling window plus `OVERDUE_GRACE_S` (no trainer
is taking them: a stopped run's leftovers, or a gateway without a trainer).

Cost: a GROUP BY over the indexed status, one over the dropped sessions' reasons, and
one over the `ended` sessions' groups (few: the trainer claims them). Admin and scrape
paths only, never the request path; called through `TrajectoryStore.episode_audit`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sqlalchemy import Engine, case, func, or_, select

from areal_service.config import TrainerConfig
from areal_service.store.schema import SessionRow
from areal_service.types import now

STATES = ("open", "ended", "claimed", "trained", "dropped")
"""The session states of the claim state machine (`claims.py`)."""
OVERDUE_GRACE_S = 300.0
"""Slack past the settling windows before a claimable `ended` session counts as overdue."""


@dataclass(frozen=True, slots=True)
class EpisodeAudit:
    """Session counts: `states` per status, `dropped_by_reason` by the reason's kind (the
    text before its first ':'), `overdue` and `unaccounted` (module docstring)."""

    states: dict[str, int]
    dropped_by_reason: dict[str, int] = field(default_factory=dict)
    overdue: int = 0
    unaccounted: int = 0
    unaccounted_why: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.states.values())


def _reason_kind(reason: str) -> str:
    return reason.split(":", 1)[0].strip()


def episode_audit(
    engine: Engine, trainer: TrainerConfig, *, at: float | None = None
) -> EpisodeAudit:
    """The audit of every session in `store` under the trainer settings `trainer`."""
    at = now() if at is None else at
    why: dict[str, int] = {}
    with engine.connect() as connection:
        by_status = dict(
            connection.execute(
                select(SessionRow.status, func.count()).group_by(SessionRow.status)
            ).all()
        )
        reasons = connection.execute(
            select(SessionRow.drop_reason, func.count())
            .where(SessionRow.status == "dropped")
            .group_by(SessionRow.drop_reason)
        ).all()
        groups = (
            connection.execute(
                select(
                    SessionRow.group_id,
                    func.count(),
                    func.sum(case((SessionRow.status == "open", 1), else_=0)),
                    func.max(SessionRow.ended_at),
                )
                .where(
                    SessionRow.status.in_(("open", "ended")),
                    or_(
                        SessionRow.group_id.is_(None),
                        SessionRow.group_id.in_(
                            select(SessionRow.group_id).where(SessionRow.status == "ended")
                        ),
                    ),
                )
                .group_by(SessionRow.group_id)
            ).all()
            if by_status.get("ended")
            else []
        )
    states = {state: int(by_status.get(state, 0)) for state in STATES}
    unknown = sum(int(n) for status, n in by_status.items() if status not in STATES)
    if unknown:
        why["unknown status"] = unknown
    dropped: dict[str, int] = {}
    for reason, n in reasons:
        if not reason:
            why["dropped without a reason"] = why.get("dropped without a reason", 0) + int(n)
            continue
        kind = _reason_kind(reason)
        dropped[kind] = dropped.get(kind, 0) + int(n)
    settle_s = trainer.reward_wait_s + (trainer.partial_group_wait_s or 0.0) + OVERDUE_GRACE_S
    size = None if trainer.group_size == 1 else trainer.group_size
    overdue = 0
    for group_id, members, n_open, last_end in groups:
        n_open = int(n_open or 0)
        n_ended = int(members) - n_open
        if group_id is None:  # ungrouped: one row for all of them, each claimable alone
            overdue += 0 if last_end is None else _ungrouped_overdue(engine, at - settle_s)
            continue
        if n_open:
            continue  # waits for its open sessions (they end, at the latest, when idle)
        if size is not None and n_ended < size and trainer.partial_group_wait_s is None:
            why["partial group that never settles"] = (
                why.get("partial group that never settles", 0) + n_ended
            )
        elif last_end is not None and last_end < at - settle_s:
            overdue += n_ended
    return EpisodeAudit(states, dropped, overdue, sum(why.values()), why)


def _ungrouped_overdue(engine: Engine, before: float) -> int:
    statement = (
        select(func.count())
        .select_from(SessionRow)
        .where(
            SessionRow.status == "ended",
            SessionRow.group_id.is_(None),
            SessionRow.ended_at < before,
        )
    )
    with engine.connect() as connection:
        return int(connection.execute(statement).scalar_one())
