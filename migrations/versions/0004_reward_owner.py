"""Reward ids scoped to the key that posted them: `rewards.owner` (the key's id, "" for
the admin key) joins the primary key, (id, owner). Before, ids were one global
namespace: a key could read another key's reward by posting its id, or squat an id so
the other's post got 409. Existing rows keep their ids with owner "" (the admin's).

Revision ID: 0004_reward_owner
Revises: 0003_requested_model
Create Date: 2026-11-24
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004_reward_owner"
down_revision: str | Sequence[str] | None = "0003_requested_model"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("rewards", recreate="always") as batch:
        batch.add_column(sa.Column("owner", sa.String(), nullable=False, server_default=""))
        batch.drop_constraint(op.f("pk_rewards"), type_="primary")
        batch.create_primary_key(op.f("pk_rewards"), ["id", "owner"])


def downgrade() -> None:
    # Refuses (IntegrityError) when two owners used one id: those rows cannot share
    # the old global namespace.
    with op.batch_alter_table("rewards", recreate="always") as batch:
        batch.drop_constraint(op.f("pk_rewards"), type_="primary")
        batch.create_primary_key(op.f("pk_rewards"), ["id"])
        batch.drop_column("owner")
