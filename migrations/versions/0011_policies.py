"""Named policies: `policy` on api_keys (the key's binding), sessions (who serves and
trains the episode), weight_versions and train_steps (versions and steps count per
policy, so the policy joins their primary keys). Existing rows get `default`, today's
single policy.

Revision ID: 0011_policies
Revises: 0010_auth_failures
Create Date: 2026-11-26
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011_policies"
down_revision: str | Sequence[str] | None = "0010_auth_failures"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_KEYED = {"weight_versions": "version", "train_steps": "step"}
"""Tables whose primary key gains the policy, and their old single key column."""


def upgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.add_column(sa.Column("policy", sa.String(), server_default="default", nullable=False))
    with op.batch_alter_table("sessions") as batch:
        batch.add_column(sa.Column("policy", sa.String(), server_default="default", nullable=False))
        batch.create_index(batch.f("ix_sessions_policy"), ["policy"], unique=False)
    for table, key in _KEYED.items():
        # SQLite's batch mode recreates the table, PostgreSQL alters it in place.
        with op.batch_alter_table(table) as batch:
            batch.add_column(
                sa.Column("policy", sa.String(), server_default="default", nullable=False)
            )
            batch.drop_constraint(f"pk_{table}", type_="primary")
            batch.create_primary_key(f"pk_{table}", ["policy", key])


def downgrade() -> None:
    for table, key in _KEYED.items():
        with op.batch_alter_table(table) as batch:
            batch.drop_constraint(f"pk_{table}", type_="primary")
            batch.create_primary_key(f"pk_{table}", [key])
            batch.drop_column("policy")
    with op.batch_alter_table("sessions") as batch:
        batch.drop_index(batch.f("ix_sessions_policy"))
        batch.drop_column("policy")
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_column("policy")
