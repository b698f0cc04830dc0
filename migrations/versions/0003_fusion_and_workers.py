"""Fusion-degree measurements, workers with heartbeats, and the worker of each trial.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "sm_fusion_measurements",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("architecture_key", sa.String(length=64), nullable=False),
        sa.Column("device_kind", sa.String(length=32), nullable=False),
        sa.Column("budget_bytes", sa.BigInteger(), nullable=False),
        sa.Column("num_members", sa.Integer(), nullable=False),
        sa.Column("trials_tokens_per_s", sa.Float(), nullable=True),
        sa.Column("peak_bytes", sa.BigInteger(), nullable=True),
        sa.Column("fits", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sm_fusion_measurements")),
        sa.UniqueConstraint(
            "architecture_key", "device_kind", "budget_bytes", "num_members",
            name=op.f("uq_sm_fusion_measurements_architecture_key_device_kind_budget_bytes_"
                      "num_members"),
        ),
    )
    op.create_table(
        "sm_workers",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("sweep_id", sa.Integer(), nullable=False),
        sa.Column("host", sa.String(length=255), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("devices", sa.Text(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint("status IN ('running', 'stopped', 'lost')",
                           name=op.f("ck_sm_workers_status")),
        sa.ForeignKeyConstraint(["sweep_id"], ["sm_sweeps.id"],
                                name=op.f("fk_sm_workers_sweep_id_sm_sweeps"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sm_workers")),
    )
    op.create_index(op.f("ix_sm_workers_sweep_id_status"), "sm_workers", ["sweep_id", "status"])
    with op.batch_alter_table("sm_trial_progress") as batch:
        batch.add_column(sa.Column("worker_id", sa.Integer(), nullable=True))
        batch.create_foreign_key(op.f("fk_sm_trial_progress_worker_id_sm_workers"),
                                 "sm_workers", ["worker_id"], ["id"], ondelete="SET NULL")


def downgrade() -> None:
    with op.batch_alter_table("sm_trial_progress") as batch:
        batch.drop_constraint(op.f("fk_sm_trial_progress_worker_id_sm_workers"),
                              type_="foreignkey")
        batch.drop_column("worker_id")
    op.drop_index(op.f("ix_sm_workers_sweep_id_status"), table_name="sm_workers")
    op.drop_table("sm_workers")
    op.drop_table("sm_fusion_measurements")
