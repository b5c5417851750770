"""What a later turn needs to continue a completion's exact token ids from the store
(`completions.continuity_key`, nullable: rows written before this revision, and turns
without a session, keep NULL). With several gateway processes a session's turns land on
any of them; a process that did not serve the previous turn finds it here.

Revision ID: 0007_continuity_key
Revises: 0006_leases
Create Date: 2026-11-24
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007_continuity_key"
down_revision: str | Sequence[str] | None = "0006_leases"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("completions") as batch:
        batch.add_column(sa.Column("continuity_key", sa.String(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("completions") as batch:
        batch.drop_column("continuity_key")
