"""Device-to-device bytes apart from swap volume: per trial and per task; a trial's re-plans.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-26 07:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("sm_trial_progress") as batch:
        batch.add_column(sa.Column("p2p_bytes", sa.BigInteger(), nullable=False,
                                   server_default="0"))
        batch.add_column(sa.Column("num_replans", sa.Integer(), nullable=False,
                                   server_default="0"))
    with op.batch_alter_table("sm_task_events") as batch:
        batch.add_column(sa.Column("p2p_bytes", sa.BigInteger(), nullable=False,
                                   server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("sm_task_events") as batch:
        batch.drop_column("p2p_bytes")
    with op.batch_alter_table("sm_trial_progress") as batch:
        batch.drop_column("num_replans")
        batch.drop_column("p2p_bytes")
