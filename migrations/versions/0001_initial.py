"""Create sweepmaster's tables: sm_sweeps, sm_trial_progress, sm_metrics.

Revision ID: 0001
Revises:
Create Date: 2025-11-21 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "sm_sweeps",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("study_name", sa.String(length=255), nullable=False),
        sa.Column("config_text", sa.Text(), nullable=False),
        sa.Column("config_hash", sa.String(length=64), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint(
            "status IN ('running', 'completed', 'interrupted', 'failed')",
            name=op.f("ck_sm_sweeps_status"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sm_sweeps")),
        sa.UniqueConstraint("name", name=op.f("uq_sm_sweeps_name")),
    )
    op.create_table(
        "sm_trial_progress",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("sweep_id", sa.Integer(), nullable=False),
        sa.Column("trial_number", sa.Integer(), nullable=False),
        sa.Column("optuna_trial_id", sa.Integer(), nullable=True),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("total_steps", sa.Integer(), nullable=False),
        sa.Column("tokens_per_s", sa.Float(), nullable=True),
        sa.Column("train_loss", sa.Float(), nullable=True),
        sa.Column("eval_loss", sa.Float(), nullable=True),
        sa.Column("objective", sa.Float(), nullable=True),
        sa.Column("device", sa.String(length=64), nullable=False),
        sa.Column("failure_reason", sa.Text(), nullable=True),
        sa.Column("checkpoint_path", sa.Text(), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint(
            "state IN ('RUNNING', 'COMPLETE', 'PRUNED', 'FAIL')",
            name=op.f("ck_sm_trial_progress_state"),
        ),
        sa.ForeignKeyConstraint(
            ["sweep_id"],
            ["sm_sweeps.id"],
            name=op.f("fk_sm_trial_progress_sweep_id_sm_sweeps"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sm_trial_progress")),
        sa.UniqueConstraint(
            "sweep_id", "trial_number", name=op.f("uq_sm_trial_progress_sweep_id_trial_number")
        ),
    )
    op.create_index(
        op.f("ix_sm_trial_progress_sweep_id_state"),
        "sm_trial_progress",
        ["sweep_id", "state"],
        unique=False,
    )
    op.create_table(
        "sm_metrics",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("trial_progress_id", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        # NULL encodes NaN (SQLite cannot store NaN); see sweepmaster.store.models.NanFloat.
        sa.Column("value", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(
            ["trial_progress_id"],
            ["sm_trial_progress.id"],
            name=op.f("fk_sm_metrics_trial_progress_id_sm_trial_progress"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sm_metrics")),
    )
    op.create_index(
        op.f("ix_sm_metrics_trial_progress_id_name_step"),
        "sm_metrics",
        ["trial_progress_id", "name", "step"],
        unique=False,
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_sm_metrics_trial_progress_id_name_step"), table_name="sm_metrics")
    op.drop_table("sm_metrics")
    op.drop_index(op.f("ix_sm_trial_progress_sweep_id_state"), table_name="sm_trial_progress")
    op.drop_table("sm_trial_progress")
    op.drop_table("sm_sweeps")
