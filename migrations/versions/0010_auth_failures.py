"""Failed-credential counts per client address and gateway process, so every process
sharing the store locks an address out on all of its failures
(`areal_service/store/auth_failures.py`).

Revision ID: 0010_auth_failures
Revises: 0009_shared_gates
Create Date: 2026-11-24
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010_auth_failures"
down_revision: str | Sequence[str] | None = "0009_shared_gates"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "auth_failures",
        sa.Column("address", sa.String(), nullable=False),
        sa.Column("holder", sa.String(), nullable=False),
        sa.Column("failures", sa.Integer(), nullable=False),
        sa.Column("last_failure", sa.Float(), nullable=False),
        sa.Column("locked_until", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("address", "holder", name=op.f("pk_auth_failures")),
    )
    op.create_index(
        op.f("ix_auth_failures_last_failure"), "auth_failures", ["last_failure"], unique=False
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_auth_failures_last_failure"), table_name="auth_failures")
    op.drop_table("auth_failures")
