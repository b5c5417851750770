"""A key's share of its policy's staleness window: each admission reservation says which
user key its places are held for (`admissions.api_key_id`, None for the admin's and for
existing rows), and sessions are indexed by (key, status) so the gate counts a key's
sessions in flight with one index range.

Revision ID: 0015_key_admissions
Revises: 0014_policy_admissions
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015_key_admissions"
down_revision: str | Sequence[str] | None = "0014_policy_admissions"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("admissions") as batch:
        batch.add_column(sa.Column("api_key_id", sa.String(), nullable=True))
    op.create_index("ix_sessions_api_key_id_status", "sessions", ["api_key_id", "status"])


def downgrade() -> None:
    op.drop_index("ix_sessions_api_key_id_status", table_name="sessions")
    with op.batch_alter_table("admissions") as batch:
        batch.drop_column("api_key_id")
