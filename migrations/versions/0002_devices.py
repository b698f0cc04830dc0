"""Spilling, scheduling and fusion records: partitions, task events, fusion groups, swap stats.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-21 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    with op.batch_alter_table("sm_trial_progress") as batch:
        batch.add_column(sa.Column("swap_bytes", sa.BigInteger(), nullable=False,
                                   server_default="0"))
        batch.add_column(sa.Column("num_promotes", sa.Integer(), nullable=False,
                                   server_default="0"))
        batch.add_column(sa.Column("num_demotes", sa.Integer(), nullable=False,
                                   server_default="0"))
        batch.add_column(sa.Column("num_shards", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("peak_device_bytes", sa.BigInteger(), nullable=True))
    op.create_table(
        "sm_partitions",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("architecture_key", sa.String(length=64), nullable=False),
        sa.Column("budget_bytes", sa.BigInteger(), nullable=False),
        sa.Column("device_kind", sa.String(length=32), nullable=False),
        sa.Column("plan_json", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sm_partitions")),
        sa.UniqueConstraint("architecture_key", "budget_bytes", "device_kind",
                            name=op.f("uq_sm_partitions_architecture_key_budget_bytes_device_kind")),
    )
    op.create_table(
        "sm_task_events",
        sa.Column("id", _BIG_ID, autoincrement=True, nullable=False),
        sa.Column("sweep_id", sa.Integer(), nullable=False),
        sa.Column("device", sa.String(length=64), nullable=False),
        sa.Column("job", sa.String(length=128), nullable=False),
        sa.Column("trial_number", sa.Integer(), nullable=True),
        sa.Column("shard", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("start_s", sa.Float(), nullable=False),
        sa.Column("end_s", sa.Float(), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("memory_bytes", sa.BigInteger(), nullable=True),
        sa.ForeignKeyConstraint(["sweep_id"], ["sm_sweeps.id"],
                                name=op.f("fk_sm_task_events_sweep_id_sm_sweeps"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sm_task_events")),
    )
    op.create_index(op.f("ix_sm_task_events_sweep_id_start_s"), "sm_task_events",
                    ["sweep_id", "start_s"])
    op.create_table(
        "sm_fusion_groups",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("sweep_id", sa.Integer(), nullable=False),
        sa.Column("job", sa.String(length=128), nullable=False),
        sa.Column("architecture_key", sa.String(length=64), nullable=False),
        sa.Column("trial_number", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(["sweep_id"], ["sm_sweeps.id"],
                                name=op.f("fk_sm_fusion_groups_sweep_id_sm_sweeps"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sm_fusion_groups")),
    )
    op.create_index(op.f("ix_sm_fusion_groups_sweep_id_job"), "sm_fusion_groups",
                    ["sweep_id", "job"])


def downgrade() -> None:
    op.drop_index(op.f("ix_sm_fusion_groups_sweep_id_job"), table_name="sm_fusion_groups")
    op.drop_table("sm_fusion_groups")
    op.drop_index(op.f("ix_sm_task_events_sweep_id_start_s"), table_name="sm_task_events")
    op.drop_table("sm_task_events")
    op.drop_table("sm_partitions")
    with op.batch_alter_table("sm_trial_progress") as batch:
        batch.drop_column("peak_device_bytes")
        batch.drop_column("num_shards")
        batch.drop_column("num_demotes")
        batch.drop_column("num_promotes")
        batch.drop_column("swap_bytes")
