"""The swap / recompute plan of activations kept beside each cached partition.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("sm_partitions") as batch:
        batch.add_column(sa.Column("memory_plan_json", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("sm_partitions") as batch:
        batch.drop_column("memory_plan_json")
