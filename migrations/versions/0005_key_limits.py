"""Per-key limits on `api_keys` (requests/min, tokens/min, concurrent requests, total
token budget; NULL: unlimited, so existing keys keep working as before) and the running
`tokens_used` the budget is checked against (0 for existing keys).

Revision ID: 0005_key_limits
Revises: 0004_reward_owner
Create Date: 2026-11-24
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005_key_limits"
down_revision: str | Sequence[str] | None = "0004_reward_owner"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.add_column(sa.Column("rpm_limit", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("tpm_limit", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("max_concurrent", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("token_budget", sa.BigInteger(), nullable=True))
        batch.add_column(
            sa.Column("tokens_used", sa.BigInteger(), nullable=False, server_default="0")
        )


def downgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        for column in ("tokens_used", "token_budget", "max_concurrent", "tpm_limit", "rpm_limit"):
            batch.drop_column(column)
