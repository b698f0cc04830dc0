"""Fused arrays refill: the array step at which each member joined and left it.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-26 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("sm_fusion_groups") as batch:
        batch.add_column(sa.Column("joined_step", sa.Integer(), nullable=False,
                                   server_default="0"))
        batch.add_column(sa.Column("left_step", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("sm_fusion_groups") as batch:
        batch.drop_column("left_step")
        batch.drop_column("joined_step")
