"""Gates every gateway process sharing the store must agree on: staleness-window
admissions in progress (`admissions`, `areal_service/store/admissions.py`) and
signed-out console cookies (`console_revocations`, `areal_service/store/revocations.py`).

Revision ID: 0009_shared_gates
Revises: 0008_key_counters
Create Date: 2026-11-24
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009_shared_gates"
down_revision: str | Sequence[str] | None = "0008_key_counters"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "admissions",
        sa.Column("id", sa.String(), nullable=False),
        sa.Column("count", sa.Integer(), nullable=False),
        sa.Column("expires_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_admissions")),
    )
    op.create_table(
        "console_revocations",
        sa.Column("nonce", sa.String(), nullable=False),
        sa.Column("expires_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("nonce", name=op.f("pk_console_revocations")),
    )


def downgrade() -> None:
    op.drop_table("console_revocations")
    op.drop_table("admissions")
