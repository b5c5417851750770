"""Multi-agent episodes: `sessions.parent_session_id` links a role sub-session (the
completions one episode had served under another policy) to the episode's own session.
Existing rows are episodes of one policy: NULL.

Revision ID: 0013_episode_roles
Revises: 0012_policy_registry
Create Date: 2026-11-26
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013_episode_roles"
down_revision: str | Sequence[str] | None = "0012_policy_registry"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("sessions") as batch:
        batch.add_column(sa.Column("parent_session_id", sa.String(), nullable=True))
        batch.create_index(
            batch.f("ix_sessions_parent_session_id"), ["parent_session_id"], unique=False
        )


def downgrade() -> None:
    with op.batch_alter_table("sessions") as batch:
        batch.drop_index(batch.f("ix_sessions_parent_session_id"))
        batch.drop_column("parent_session_id")
