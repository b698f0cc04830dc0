"""Stored sweep configurations hold no database password: the storage URL's is masked.

A sweep's ``config_text`` held the ``storage:`` URL as given, password included, and the
dashboard served it (``/api/sweeps/{name}``). New records are masked when written
(:meth:`~sweepmaster.config.SweepConfig.canonical_text`); this masks the existing ones the
same way and recomputes their ``config_hash``. The passwords are gone: there is no downgrade
that brings them back (downgrading keeps the masked text).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-07 21:30:00
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from sweepmaster.store.engine import masked_text

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_SWEEPS = sa.table("sm_sweeps", sa.column("id", sa.Integer), sa.column("config_text", sa.Text),
                   sa.column("config_hash", sa.String))


def upgrade() -> None:
    connection = op.get_bind()
    rows = connection.execute(sa.select(_SWEEPS.c.id, _SWEEPS.c.config_text)).all()
    for sweep_id, text in rows:
        masked = masked_text(text)
        if masked != text:
            connection.execute(
                _SWEEPS.update().where(_SWEEPS.c.id == sweep_id).values(
                    config_text=masked,
                    config_hash=hashlib.sha256(masked.encode("utf-8")).hexdigest()))


def downgrade() -> None:
    """Nothing to undo: the masked text stays (the passwords cannot be brought back)."""
