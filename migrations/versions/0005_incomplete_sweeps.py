"""A sweep's status may be ``incomplete``: it ended with grid cells or trials left unfinished.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-25 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_BEFORE = ("running", "completed", "interrupted", "failed")
_AFTER = (*_BEFORE, "incomplete")


def _check(statuses: Sequence[str]) -> str:
    return "status IN (" + ", ".join(f"'{s}'" for s in statuses) + ")"


def upgrade() -> None:
    with op.batch_alter_table("sm_sweeps", recreate="auto") as batch:
        batch.drop_constraint(op.f("ck_sm_sweeps_status"), type_="check")
        batch.create_check_constraint(op.f("ck_sm_sweeps_status"), _check(_AFTER))


def downgrade() -> None:
    op.execute("UPDATE sm_sweeps SET status = 'failed' WHERE status = 'incomplete'")
    with op.batch_alter_table("sm_sweeps", recreate="auto") as batch:
        batch.drop_constraint(op.f("ck_sm_sweeps_status"), type_="check")
        batch.create_check_constraint(op.f("ck_sm_sweeps_status"), _check(_BEFORE))
