"""The dashboard's device views: the shard tasks of the timeline and the fused arrays' members.

The executor writes both tables (``sm_task_events``, ``sm_fusion_groups``); a database written
by an older sweepmaster may lack them or their later columns, so each query returns ``None``
while its table does not exist and reads a missing optional column as its default.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import MetaData, Table, literal, null, select
from sqlalchemy.engine import Connection, Engine

from sweepmaster.runtime.events import TASK_STATISTICS, TaskStatistics
from sweepmaster.store import optuna_tables as ot
from sweepmaster.store.models import Base, FusionGroupMember
from sweepmaster.store.models import TaskEvent as TaskEventRow

__all__ = [
    "FUSION_GROUPS_OPTIONAL",
    "TASK_EVENTS_OPTIONAL",
    "FusionMember",
    "TaskEvent",
    "fusion_members",
    "task_events",
]


TASK_EVENTS_OPTIONAL = tuple(stat.column_name for stat in TASK_STATISTICS if stat.optional)
"""Columns of ``sm_task_events`` (:class:`~sweepmaster.store.models.TaskEvent`) that a database
written by an older sweepmaster may lack: the optional statistics (``memory_bytes``, and
``p2p_bytes``, written since pipelined steps). The timeline needs every other column."""

FUSION_GROUPS_OPTIONAL = ("joined_step", "left_step")
"""Columns of ``sm_fusion_groups`` (:class:`~sweepmaster.store.models.FusionGroupMember`) that a
database written before fused arrays refilled lacks. The fusion view needs every other column."""


@dataclass(frozen=True)
class TaskEvent(TaskStatistics):
    """One shard task on one device (a row of ``sm_task_events``), with its statistics."""

    device: str
    job: str
    trial_number: int | None
    shard: int
    kind: str
    start_s: float
    end_s: float


@dataclass(frozen=True)
class FusionMember:
    """One member trial of a fused array (a row of ``sm_fusion_groups``)."""

    job: str
    architecture_key: str
    trial_number: int
    joined_step: int = 0
    left_step: int | None = None


# -- tables written by later executors -----------------------------------------------------------
def _optional_table(connection: Connection, model: type[Base],
                    optional: Sequence[str]) -> Table | None:
    """The table of ``model`` as the database has it, or ``None`` while it does not exist.

    Raises:
        ValueError: It lacks a column of ``model`` (but its key) that is not ``optional``.
    """
    name = model.__tablename__
    if not ot.has_table(connection, name):
        return None
    table = Table(name, MetaData(), autoload_with=connection)
    needed = [c.name for c in model.__table__.c if not c.primary_key and c.name not in optional]
    missing = [name for name in needed if name not in table.c]
    if missing:
        raise ValueError(f"table {name} lacks the column(s) {', '.join(missing)}")
    return table


def _statistics(values: Sequence[Any]) -> dict[str, Any]:
    """A row's :data:`TASK_STATISTICS` by name: missing ones 0, or ``None`` where nullable."""
    return {stat.name: (None if stat.nullable else 0) if v is None else int(v)
            for stat, v in zip(TASK_STATISTICS, values, strict=True)}


def task_events(
    engine: Engine, sweep_id: int, limit: int = 20_000
) -> tuple[list[TaskEvent], bool] | None:
    """Return the latest shard tasks of a sweep from ``sm_task_events``, by start time.

    Args:
        engine: An engine on the sweep database.
        sweep_id: The sweep's ``id``.
        limit: Most tasks to return (the latest ones).

    Returns:
        ``(events, truncated)``, or ``None`` when the table does not exist yet.

    Raises:
        ValueError: The table exists but lacks a column of
            :class:`~sweepmaster.store.models.TaskEvent` but :data:`TASK_EVENTS_OPTIONAL`.
    """
    with engine.connect() as connection:
        table = _optional_table(connection, TaskEventRow, TASK_EVENTS_OPTIONAL)
        if table is None:
            return None
        c = table.c
        stats = [c[s.column_name] if s.column_name in c else null() for s in TASK_STATISTICS]
        columns = [c.device, c.job, c.trial_number, c.shard, c.kind, c.start_s, c.end_s]
        query = (
            select(*columns, *stats)
            .where(c.sweep_id == sweep_id)
            .order_by(c.start_s.desc())
            .limit(limit + 1)
        )
        rows = connection.execute(query).all()
    events = [
        TaskEvent(
            device=str(r[0]),
            job=str(r[1]),
            trial_number=r[2],
            shard=int(r[3]),
            kind=str(r[4]),
            start_s=float(r[5]),
            end_s=float(r[6]),
            **_statistics(r[7:]),
        )
        for r in rows[:limit]
    ]
    events.reverse()
    return events, len(rows) > limit


def fusion_members(engine: Engine, sweep_id: int) -> list[FusionMember] | None:
    """Return the members of a sweep's fused arrays from ``sm_fusion_groups``.

    Args:
        engine: An engine on the sweep database.
        sweep_id: The sweep's ``id``.

    Returns:
        Members ordered by job, the array step they joined at and trial number, or ``None``
        when the table does not exist.

    Raises:
        ValueError: The table exists but lacks a column of
            :class:`~sweepmaster.store.models.FusionGroupMember` but
            :data:`FUSION_GROUPS_OPTIONAL`.
    """
    with engine.connect() as connection:
        table = _optional_table(connection, FusionGroupMember, FUSION_GROUPS_OPTIONAL)
        if table is None:
            return None
        c = table.c
        joined = c.joined_step if "joined_step" in c else literal(0)
        left = c.left_step if "left_step" in c else null()
        query = (
            select(c.job, c.architecture_key, c.trial_number, joined, left)
            .where(c.sweep_id == sweep_id)
            .order_by(c.job, joined, c.trial_number)
        )
        return [FusionMember(str(j), str(k), int(n), int(s or 0), None if e is None else int(e))
                for j, k, n, s, e in connection.execute(query)]
