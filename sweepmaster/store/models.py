"""SQLAlchemy ORM of sweepmaster's own tables.

Every table name starts with ``sm_``: Optuna's ``RDBStorage`` keeps its own tables (``studies``,
``trials``, ...) and its own ``alembic_version`` in the same database, and neither sweepmaster's
models nor its migrations (``migrations/``, version table :data:`ALEMBIC_VERSION_TABLE`) touch
them.

The ORM classes stay inside :mod:`sweepmaster.store`; values that leave it are frozen dataclasses
(:mod:`sweepmaster.store.queries`).
"""

from __future__ import annotations

import math
from datetime import datetime, timezone
from typing import Any, Literal, get_args

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

from sweepmaster.runtime.events import TASK_STATISTICS, TRIAL_STATISTICS, Statistic

__all__ = [
    "ALEMBIC_VERSION_TABLE",
    "FINAL_TRIAL_STATES",
    "SWEEP_STATUSES",
    "TABLE_PREFIX",
    "TRIAL_STATES",
    "Base",
    "FusionGroupMember",
    "FusionMeasurementRecord",
    "Metric",
    "Partition",
    "Sweep",
    "SweepStatus",
    "TaskEvent",
    "TrialProgress",
    "TrialStateName",
    "WORKER_STATUSES",
    "Worker",
    "WorkerStatus",
    "utcnow",
]

TABLE_PREFIX = "sm_"
"""Prefix of every sweepmaster table; migrations' autogenerate ignores all other tables."""

ALEMBIC_VERSION_TABLE = "sweepmaster_alembic_version"
"""Alembic version table of sweepmaster's migrations (Optuna owns ``alembic_version``)."""

SweepStatus = Literal["running", "completed", "interrupted", "failed", "incomplete"]
SWEEP_STATUSES: tuple[str, ...] = get_args(SweepStatus)

TrialStateName = Literal["RUNNING", "COMPLETE", "PRUNED", "FAIL"]
"""Trial states, spelled like ``optuna.trial.TrialState`` names."""
TRIAL_STATES: tuple[str, ...] = get_args(TrialStateName)
FINAL_TRIAL_STATES: tuple[str, ...] = ("COMPLETE", "PRUNED", "FAIL")

WorkerStatus = Literal["running", "stopped", "lost"]
"""A worker runs, stopped cleanly, or stopped sending heartbeats (its trials are retried)."""
WORKER_STATUSES: tuple[str, ...] = get_args(WorkerStatus)


def utcnow() -> datetime:
    """Return the current time as a timezone-aware UTC datetime."""
    return datetime.now(timezone.utc)


class UTCDateTime(TypeDecorator[datetime]):
    """A ``DateTime(timezone=True)`` that always binds and returns timezone-aware UTC values.

    SQLite stores no offset, so values are converted to UTC before they are written and marked
    UTC when read; PostgreSQL's ``timestamptz`` results are converted to UTC.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        assert value.tzinfo is not None, "sweepmaster stores timezone-aware datetimes only"
        return value.astimezone(timezone.utc)

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=timezone.utc)  # type: ignore[no-any-return]
        return value.astimezone(timezone.utc)  # type: ignore[no-any-return]


class NanAsNullFloat(TypeDecorator[float]):
    """A float column that stores NaN as NULL on every backend.

    SQLite cannot store NaN (it binds it as NULL), PostgreSQL can; mapping NaN to NULL everywhere
    keeps both backends identical. Reads return ``None`` for NULL.
    """

    impl = Float
    cache_ok = True

    def process_bind_param(self, value: float | None, dialect: Dialect) -> float | None:
        if value is None or math.isnan(value):
            return None
        return float(value)


class NanFloat(NanAsNullFloat):
    """A float column where NULL *is* NaN: NaN is written as NULL and NULL is read as NaN.

    Used where a value is always present (metric values), so NULL can only mean NaN.
    """

    cache_ok = True

    def process_result_value(self, value: Any, dialect: Dialect) -> float:
        return math.nan if value is None else float(value)


class Base(DeclarativeBase):
    """Declarative base of sweepmaster's tables, with named constraints for batch migrations."""

    metadata = MetaData(
        naming_convention={
            "ix": "ix_%(table_name)s_%(column_0_N_name)s",
            "uq": "uq_%(table_name)s_%(column_0_N_name)s",
            "ck": "ck_%(table_name)s_%(constraint_name)s",
            "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
            "pk": "pk_%(table_name)s",
        }
    )


def _in_check(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


class Sweep(Base):
    """One sweep: a ``sweep.yaml`` and the Optuna study it drives."""

    __tablename__ = "sm_sweeps"
    __table_args__ = (CheckConstraint(_in_check("status", SWEEP_STATUSES), name="status"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(255), unique=True)
    study_name: Mapped[str] = mapped_column(String(255))
    config_text: Mapped[str] = mapped_column(Text)
    config_hash: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)


def _statistic_columns(model: type[Base], table: tuple[Statistic, ...]) -> None:
    """Map a column of ``model`` per statistic of ``table`` (named :attr:`Statistic.column_name`).

    Bytes are ``BIGINT``, counts ``INTEGER``; a statistic that can be unknown is nullable, any
    other is ``NOT NULL`` with 0 as its default, and with a server default of 0 where a
    migration added it to a table that already had rows.
    """
    for stat in table:
        type_ = BigInteger if stat.unit == "bytes" else Integer
        column: Any
        if stat.nullable:
            column = mapped_column(type_, nullable=True)
        elif stat.added_in is None:
            column = mapped_column(type_, nullable=False, default=0)
        else:
            column = mapped_column(type_, nullable=False, default=0, server_default="0")
        setattr(model, stat.column_name, column)


class TrialProgress(Base):
    """Live progress and final state of one trial of a sweep (one row per trial number).

    Besides the columns below, one column per statistic of
    :data:`~sweepmaster.runtime.events.TRIAL_STATISTICS`.
    """

    __tablename__ = "sm_trial_progress"
    __table_args__ = (
        UniqueConstraint("sweep_id", "trial_number"),
        Index(None, "sweep_id", "state"),
        CheckConstraint(_in_check("state", TRIAL_STATES), name="state"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    sweep_id: Mapped[int] = mapped_column(ForeignKey("sm_sweeps.id", ondelete="CASCADE"))
    trial_number: Mapped[int] = mapped_column(Integer)
    optuna_trial_id: Mapped[int | None] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16))
    step: Mapped[int] = mapped_column(Integer)
    total_steps: Mapped[int] = mapped_column(Integer)
    tokens_per_s: Mapped[float | None] = mapped_column(NanAsNullFloat)
    train_loss: Mapped[float | None] = mapped_column(NanAsNullFloat)
    eval_loss: Mapped[float | None] = mapped_column(NanAsNullFloat)
    objective: Mapped[float | None] = mapped_column(NanAsNullFloat)
    device: Mapped[str] = mapped_column(String(64))
    failure_reason: Mapped[str | None] = mapped_column(Text)
    checkpoint_path: Mapped[str | None] = mapped_column(Text)
    started_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)
    worker_id: Mapped[int | None] = mapped_column(
        ForeignKey("sm_workers.id", ondelete="SET NULL"), nullable=True
    )


class Metric(Base):
    """One scalar of one trial at one optimizer step: ``train_loss``, ``lr``, ``eval_loss``..."""

    __tablename__ = "sm_metrics"
    __table_args__ = (Index(None, "trial_progress_id", "name", "step"),)

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    trial_progress_id: Mapped[int] = mapped_column(
        ForeignKey("sm_trial_progress.id", ondelete="CASCADE")
    )
    step: Mapped[int] = mapped_column(Integer)
    name: Mapped[str] = mapped_column(String(64))
    value: Mapped[float] = mapped_column(NanFloat, nullable=True)


class Partition(Base):
    """A cached partition (shard plan) of one architecture under one device budget.

    ``memory_plan_json`` is the swap / recompute plan of the activations the executor made for
    that partition (:class:`~sweepmaster.runtime.planning.memplan.MemoryPlan`), once it trained a
    job.
    """

    __tablename__ = "sm_partitions"
    __table_args__ = (UniqueConstraint("architecture_key", "budget_bytes", "device_kind"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    architecture_key: Mapped[str] = mapped_column(String(64))
    budget_bytes: Mapped[int] = mapped_column(BigInteger)
    device_kind: Mapped[str] = mapped_column(String(32))
    plan_json: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    memory_plan_json: Mapped[str | None] = mapped_column(Text, nullable=True)


class TaskEvent(Base):
    """One shard task (or transfer) a device ran: the dashboard's device timeline.

    Besides the columns below, one column per statistic of
    :data:`~sweepmaster.runtime.events.TASK_STATISTICS` (``bytes``, ``memory_bytes``,
    ``p2p_bytes``).
    """

    __tablename__ = "sm_task_events"
    __table_args__ = (Index(None, "sweep_id", "start_s"),)

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    sweep_id: Mapped[int] = mapped_column(ForeignKey("sm_sweeps.id", ondelete="CASCADE"))
    device: Mapped[str] = mapped_column(String(64))
    job: Mapped[str] = mapped_column(String(128))
    trial_number: Mapped[int | None] = mapped_column(Integer)
    shard: Mapped[int] = mapped_column(Integer)
    kind: Mapped[str] = mapped_column(String(16))
    start_s: Mapped[float] = mapped_column(Float)
    end_s: Mapped[float] = mapped_column(Float)


_statistic_columns(TrialProgress, TRIAL_STATISTICS)
_statistic_columns(TaskEvent, TASK_STATISTICS)


class FusionGroupMember(Base):
    """One member trial of a fused array (one row per member).

    A refilling array takes new members as others leave: ``joined_step`` and ``left_step`` are
    the array's own step counts (fused steps since it started) when the trial joined (0: it
    founded the array) and left it (``NULL`` while it trains, or if it failed unrecorded).
    """

    __tablename__ = "sm_fusion_groups"
    __table_args__ = (Index(None, "sweep_id", "job"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    sweep_id: Mapped[int] = mapped_column(ForeignKey("sm_sweeps.id", ondelete="CASCADE"))
    job: Mapped[str] = mapped_column(String(128))
    architecture_key: Mapped[str] = mapped_column(String(64))
    trial_number: Mapped[int] = mapped_column(Integer)
    joined_step: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    left_step: Mapped[int | None] = mapped_column(Integer)


class FusionMeasurementRecord(Base):
    """Measured throughput of a fused array of K members of one architecture on one device kind.

    mu-TWO's sub-array selection measures K = 1, 2, 4, ... once per architecture and device and
    picks the best; the measurement is kept here so later launches reuse it.
    """

    __tablename__ = "sm_fusion_measurements"
    __table_args__ = (
        UniqueConstraint("architecture_key", "device_kind", "budget_bytes", "num_members"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    architecture_key: Mapped[str] = mapped_column(String(64))
    device_kind: Mapped[str] = mapped_column(String(32))
    budget_bytes: Mapped[int] = mapped_column(BigInteger)
    num_members: Mapped[int] = mapped_column(Integer)
    trials_tokens_per_s: Mapped[float | None] = mapped_column(NanAsNullFloat)
    peak_bytes: Mapped[int | None] = mapped_column(BigInteger)
    fits: Mapped[bool] = mapped_column(Boolean)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class Worker(Base):
    """One process training a sweep's trials (``launch`` or ``worker``), with its heartbeat."""

    __tablename__ = "sm_workers"
    __table_args__ = (
        Index(None, "sweep_id", "status"),
        CheckConstraint(_in_check("status", WORKER_STATUSES), name="status"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    sweep_id: Mapped[int] = mapped_column(ForeignKey("sm_sweeps.id", ondelete="CASCADE"))
    host: Mapped[str] = mapped_column(String(255))
    pid: Mapped[int] = mapped_column(Integer)
    devices: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String(16))
    started_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    heartbeat_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
