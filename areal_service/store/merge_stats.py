"""How well multi-turn sessions merge into training sequences (the console's figure).

A session's completions form a tree through `parent_id` (exact-prefix links, see
`linking.py`); each leaf ends one training sequence of length prompt + output
(`episodes.build_sequences`). One sequence per session and trained ≈ context tokens is
the goal: a session split into one sequence per turn trains O(T²) tokens (see the
gateway's token continuity). Read-only; one aggregate query over recent completions,
called through `TrajectoryStore.merge_stats`.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Engine, case, exists, func, select
from sqlalchemy.orm import aliased

from areal_service.store.schema import CompletionRow

RECENT_COMPLETIONS = 5000
"""Completions the figure covers, newest first (bounds the query on a large store)."""


@dataclass(frozen=True, slots=True)
class MergeStats:
    """Over recent completions that belong to a session: sessions, completions, training
    sequences (leaves of the parent tree), generated tokens, and tokens the sequences
    hold (what the trainer processes)."""

    sessions: int
    completions: int
    sequences: int
    tokens_generated: int
    tokens_trained: int

    @property
    def sequences_per_session(self) -> float | None:
        return self.sequences / self.sessions if self.sessions else None

    @property
    def trained_per_generated(self) -> float | None:
        return self.tokens_trained / self.tokens_generated if self.tokens_generated else None


def merge_stats(engine: Engine, recent: int = RECENT_COMPLETIONS) -> MergeStats:
    """`MergeStats` of the newest `recent` session completions. Parent links are taken as
    recorded (not re-verified as `build_sequences` does), and a completion whose child
    falls outside the window counts as a leaf: a close estimate, not the export."""
    rows = (
        select(
            CompletionRow.id,
            CompletionRow.session_id,
            CompletionRow.prompt_tokens,
            CompletionRow.completion_tokens,
        )
        .where(CompletionRow.session_id.is_not(None))
        .order_by(CompletionRow.created_at.desc())
        .limit(recent)
        .subquery()
    )
    child = aliased(CompletionRow)
    leaf = ~exists().where(child.parent_id == rows.c.id)
    statement = select(
        func.count(func.distinct(rows.c.session_id)),
        func.count(),
        func.coalesce(func.sum(case((leaf, 1), else_=0)), 0),
        func.coalesce(func.sum(rows.c.completion_tokens), 0),
        func.coalesce(
            func.sum(case((leaf, rows.c.prompt_tokens + rows.c.completion_tokens), else_=0)), 0
        ),
    )
    with engine.connect() as connection:
        sessions, completions, sequences, generated, trained = connection.execute(statement).one()
    return MergeStats(int(sessions), int(completions), int(sequences), int(generated), int(trained))
