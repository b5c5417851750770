"""The model name a client sent, on each completion (`completions.requested_model`,
nullable: rows written before this revision keep NULL). The gateway serves every name
with the policy by default, so `model` alone no longer says what the client asked for.

Revision ID: 0003_requested_model
Revises: 0002_episodes
Create Date: 2026-11-24
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003_requested_model"
down_revision: str | Sequence[str] | None = "0002_episodes"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("completions") as batch:
        batch.add_column(sa.Column("requested_model", sa.String(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("completions") as batch:
        batch.drop_column("requested_model")
