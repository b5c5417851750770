"""Policies created at runtime (`POST /admin/policies`): `policies` (name, LoRA shape)
and `policy_model_names` (each request model name that picks one, unique across them),
so every gateway process and trainer sharing the store sees them
(`areal_service/store/policy_registry.py`).

Revision ID: 0012_policy_registry
Revises: 0011_policies
Create Date: 2026-11-26
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012_policy_registry"
down_revision: str | Sequence[str] | None = "0011_policies"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "policies",
        sa.Column("name", sa.String(), nullable=False),
        sa.Column("lora", sa.JSON(), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_policies")),
    )
    op.create_table(
        "policy_model_names",
        sa.Column("model_name", sa.String(), nullable=False),
        sa.Column("policy", sa.String(), nullable=False),
        sa.PrimaryKeyConstraint("model_name", name=op.f("pk_policy_model_names")),
    )
    op.create_index(
        op.f("ix_policy_model_names_policy"), "policy_model_names", ["policy"], unique=False
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_policy_model_names_policy"), table_name="policy_model_names")
    op.drop_table("policy_model_names")
    op.drop_table("policies")
