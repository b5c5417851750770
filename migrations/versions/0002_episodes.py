"""Episodes: claim columns on sessions (claim_id, claimed_by, claimed_at, trained_at,
drop_reason), an index on completions.parent_id, and the prefix hash of every
completion (full_len, full_hash), backfilled for rows written before this revision.

Revision ID: 0002_episodes
Revises: 0001_initial
Create Date: 2026-11-23
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002_episodes"
down_revision: str | Sequence[str] | None = "0001_initial"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_SESSION_COLUMNS = {
    "claim_id": sa.String,
    "claimed_by": sa.String,
    "claimed_at": sa.Float,
    "trained_at": sa.Float,
    "drop_reason": sa.String,
}
_BACKFILL_PAGE = 500


def _backfill_hashes() -> None:
    """Hash existing completions in keyset pages (bounded memory). Frozen copy of the
    rule in areal_service/episodes.py: blake2b-128 of the packed prompt then output."""
    table = sa.table(
        "completions",
        sa.column("id", sa.String()),
        sa.column("prompt_ids", sa.LargeBinary()),
        sa.column("output_ids", sa.LargeBinary()),
        sa.column("full_len", sa.Integer()),
        sa.column("full_hash", sa.String()),
    )
    connection = op.get_bind()
    last = ""
    while True:
        rows = connection.execute(
            sa.select(table.c.id, table.c.prompt_ids, table.c.output_ids)
            .where(table.c.full_hash.is_(None), table.c.id > last)
            .order_by(table.c.id)
            .limit(_BACKFILL_PAGE)
        ).all()
        if not rows:
            return
        connection.execute(
            table.update()
            .where(table.c.id == sa.bindparam("cid"))
            .values(full_len=sa.bindparam("n"), full_hash=sa.bindparam("h")),
            [
                {
                    "cid": cid,
                    "n": (len(prompt) + len(output)) // 4,
                    "h": hashlib.blake2b(prompt + output, digest_size=16).hexdigest(),
                }
                for cid, prompt, output in rows
            ],
        )
        last = rows[-1][0]


def upgrade() -> None:
    with op.batch_alter_table("sessions") as batch:
        for name, column_type in _SESSION_COLUMNS.items():
            batch.add_column(sa.Column(name, column_type(), nullable=True))
        batch.create_index(batch.f("ix_sessions_claim_id"), ["claim_id"], unique=False)
    with op.batch_alter_table("completions") as batch:
        batch.add_column(sa.Column("full_len", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("full_hash", sa.String(length=32), nullable=True))
        batch.create_index(batch.f("ix_completions_parent_id"), ["parent_id"], unique=False)
    _backfill_hashes()


def downgrade() -> None:
    with op.batch_alter_table("completions") as batch:
        batch.drop_index(batch.f("ix_completions_parent_id"))
        batch.drop_column("full_hash")
        batch.drop_column("full_len")
    with op.batch_alter_table("sessions") as batch:
        batch.drop_index(batch.f("ix_sessions_claim_id"))
        for name in reversed(list(_SESSION_COLUMNS)):
            batch.drop_column(name)
