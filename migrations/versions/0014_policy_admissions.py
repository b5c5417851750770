"""Per-policy staleness windows: each admission reservation (`admissions`) says whose
window its places are held in, so a policy's gate counts only its own sessions and
reservations. Existing rows (places held for a few seconds at most) get `default`.

Revision ID: 0014_policy_admissions
Revises: 0013_episode_roles
Create Date: 2026-11-26
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014_policy_admissions"
down_revision: str | Sequence[str] | None = "0013_episode_roles"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("admissions") as batch:
        batch.add_column(sa.Column("policy", sa.String(), server_default="default", nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("admissions") as batch:
        batch.drop_column("policy")
