"""Roles of runtime policies and their changes: `policies.roles` (the policies a runtime
policy's episodes may open as roles, a JSON list; NULL for rows written before this
revision: none) and `policies.updated_at` (when its roles last changed; NULL: never),
which the gateways' refresher compares to see a change (`PolicyStore.policies_mark`).

Revision ID: 0016_policy_roles
Revises: 0015_key_admissions
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016_policy_roles"
down_revision: str | Sequence[str] | None = "0015_key_admissions"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("policies") as batch:
        batch.add_column(sa.Column("roles", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("updated_at", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("policies") as batch:
        batch.drop_column("updated_at")
        batch.drop_column("roles")
