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

from sweepmaster.runtime.execution.events import TASK_STATISTICS, TaskStatistics
from sweepmaster.store import optuna_tables as ot

__all__ = [
    "FUSION_GROUPS_COLUMNS",
    "FUSION_GROUPS_TABLE",
    "TASK_EVENTS_COLUMNS",
    "TASK_EVENTS_TABLE",
    "FusionMember",
    "TaskEvent",
    "fusion_members",
    "task_events",
]


TASK_EVENTS_TABLE = "sm_task_events"
TASK_EVENTS_COLUMNS: dict[str, str] = {
    "sweep_id": "INTEGER, the sweep (sm_sweeps.id)",
    "device": "VARCHAR, the device that ran the task, e.g. 'cuda:0' or 'virtual:1'",
    "job": "VARCHAR, the job: 'trial-<N>' or a fused array's id",
    "trial_number": "INTEGER NULL, the trial of a single-trial job (NULL for a fused array)",
    "shard": "INTEGER, shard index within the job",
    "kind": "VARCHAR, forward | backward | eval | update | train | pipeline | demote",
    "start_s": "DOUBLE, start as UNIX time in seconds",
    "end_s": "DOUBLE, end as UNIX time in seconds",
    **{stat.column_name: f"{'BIGINT' if stat.unit == 'bytes' else 'INTEGER'}"
                         f"{' NULL' if stat.nullable else ''}"
                         f"{' (optional column)' if stat.optional else ''}, {stat.description}"
       for stat in TASK_STATISTICS},
}
"""Columns the device timeline reads from ``sm_task_events``, one row per shard task.

The SHARP executor owns the table and its migration; the dashboard only reads it. Every column
is required but the optional statistics' (``Statistic.optional``: ``memory_bytes``, and
``p2p_bytes``, written since pipelined steps). An index on ``(sweep_id, start_s)`` keeps the
timeline query fast."""

FUSION_GROUPS_TABLE = "sm_fusion_groups"
FUSION_GROUPS_COLUMNS: dict[str, str] = {
    "sweep_id": "INTEGER, the sweep (sm_sweeps.id)",
    "job": "VARCHAR, the fused array's job id",
    "architecture_key": "VARCHAR, the architecture key its members share",
    "trial_number": "INTEGER, one member trial (one row per member)",
    "joined_step": "INTEGER (optional column), array steps before the trial joined (0: founder)",
    "left_step": "INTEGER NULL (optional column), the array's steps when it left (NULL: training)",
}
"""Columns the fusion view reads from ``sm_fusion_groups``, one row per member of a fused array.

Every column but ``joined_step`` and ``left_step`` (written since arrays refill) is required."""


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
def _optional_table(connection: Connection, name: str, required: Sequence[str]) -> Table | None:
    if not ot.has_table(connection, name):
        return None
    table = Table(name, MetaData(), autoload_with=connection)
    missing = [c for c in required if c not in table.c]
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
        ValueError: The table exists but lacks a column of :data:`TASK_EVENTS_COLUMNS`.
    """
    with engine.connect() as connection:
        optional = {stat.column_name for stat in TASK_STATISTICS if stat.optional}
        required = [c for c in TASK_EVENTS_COLUMNS if c not in optional]
        table = _optional_table(connection, TASK_EVENTS_TABLE, required)
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
        ValueError: The table exists but lacks a required column of
            :data:`FUSION_GROUPS_COLUMNS`.
    """
    optional = ("joined_step", "left_step")
    with engine.connect() as connection:
        required = [c for c in FUSION_GROUPS_COLUMNS if c not in optional]
        table = _optional_table(connection, FUSION_GROUPS_TABLE, required)
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
