"""Per-key live counts of each gateway process (`key_counters`), so per-key limits hold
across the workers and replicas that share the store (`areal_service/store/
key_counters.py`).

Revision ID: 0008_key_counters
Revises: 0007_continuity_key
Create Date: 2026-11-24
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008_key_counters"
down_revision: str | Sequence[str] | None = "0007_continuity_key"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "key_counters",
        sa.Column("key_id", sa.String(), nullable=False),
        sa.Column("holder", sa.String(), nullable=False),
        sa.Column("requests", sa.Integer(), nullable=False),
        sa.Column("tokens", sa.BigInteger(), nullable=False),
        sa.Column("in_flight", sa.Integer(), nullable=False),
        sa.Column("unflushed_tokens", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("key_id", "holder", name=op.f("pk_key_counters")),
    )


def downgrade() -> None:
    op.drop_table("key_counters")
