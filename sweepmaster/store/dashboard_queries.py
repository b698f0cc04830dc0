"""Read-only queries behind the web dashboard: sweeps, trial tables, curves, device timelines.

The dashboard joins sweepmaster's ``sm_*`` tables with Optuna's own tables in the same database.
Optuna's public API (``study.get_trials``) materializes every trial with all of its attributes,
which for a 10,000-trial sweep costs seconds per request (``bench/dashboard.py`` measures it);
one page of the trial table needs about 50 rows. So Optuna's tables are read here with
SQLAlchemy Core (select, filter, sort and page in the database), declared on a private
:class:`~sqlalchemy.MetaData` that nothing ever creates, alters or writes. Their layout is
Optuna's RDB storage schema (unchanged from Optuna 3 through 5): enum columns hold the enum
*names* (``'COMPLETE'``; a native enum on PostgreSQL, hence the casts to ``VARCHAR``) and
datetimes are naive UTC.

Tables that later executors write are optional: ``sm_task_events`` (the device timeline, see
:data:`TASK_EVENTS_COLUMNS`) and ``sm_fusion_groups`` (see :data:`FUSION_GROUPS_COLUMNS`). While
a table does not exist its query returns ``None``.

Every function takes an :class:`~sqlalchemy.engine.Engine` and returns frozen dataclasses or
plain values, never ORM objects. One module rather than several: the queries share the Optuna
table declarations and the trial-row select.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import lru_cache
from typing import Any

from optuna.distributions import BaseDistribution, json_to_distribution
from sqlalchemy import (
    Column,
    DateTime,
    Float,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    and_,
    case,
    cast,
    func,
    inspect,
    literal,
    null,
    select,
)
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.sql.elements import ColumnElement

from sweepmaster.runtime.execution.events import TASK_STATISTICS, TaskStatistics
from sweepmaster.store.models import FusionGroupMember, Metric, Sweep, TrialProgress
from sweepmaster.store.models import TaskEvent as TaskEventRow
from sweepmaster.store.queries import SweepInfo

__all__ = [
    "FUSION_GROUPS_COLUMNS",
    "SORT_KEYS",
    "TASK_EVENTS_COLUMNS",
    "Curve",
    "FusionMember",
    "SweepOverview",
    "TaskEvent",
    "TrialDetailRecord",
    "TrialLinks",
    "TrialRecord",
    "active_trial_states",
    "changed_progress",
    "fusion_members",
    "list_sweep_overviews",
    "sweep_overview",
    "task_events",
    "trial_detail",
    "trial_links",
    "trial_page",
    "trial_records",
]

# -- Optuna's tables (read-only; only the columns read here) ------------------------------------
_optuna = MetaData()
_studies = Table(
    "studies", _optuna, Column("study_id", Integer), Column("study_name", String(512))
)
_directions = Table(
    "study_directions",
    _optuna,
    Column("study_id", Integer),
    Column("direction", String(8)),
    Column("objective", Integer),
)
_trials = Table(
    "trials",
    _optuna,
    Column("trial_id", Integer),
    Column("number", Integer),
    Column("study_id", Integer),
    Column("state", String(8)),
    Column("datetime_start", DateTime),
    Column("datetime_complete", DateTime),
)
_params = Table(
    "trial_params",
    _optuna,
    Column("trial_id", Integer),
    Column("param_name", String(512)),
    Column("param_value", Float),
    Column("distribution_json", Text),
)
_values = Table(
    "trial_values",
    _optuna,
    Column("trial_id", Integer),
    Column("objective", Integer),
    Column("value", Float),
    Column("value_type", String(8)),
)
_intermediates = Table(
    "trial_intermediate_values",
    _optuna,
    Column("trial_id", Integer),
    Column("step", Integer),
    Column("intermediate_value", Float),
    Column("intermediate_value_type", String(8)),
)
_user_attrs = Table(
    "trial_user_attributes",
    _optuna,
    Column("trial_id", Integer),
    Column("key", String(512)),
    Column("value_json", Text),
)
_system_attrs = Table(
    "trial_system_attributes",
    _optuna,
    Column("trial_id", Integer),
    Column("key", String(512)),
    Column("value_json", Text),
)

_FAIL_REASON_ATTR = "fail_reason"  # sweepmaster.study.FAIL_REASON_ATTR (store cannot import it)

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

SORT_KEYS: tuple[str, ...] = (
    "number",
    "state",
    "objective",
    "step",
    "progress",
    "tokens_per_s",
    "train_loss",
    "eval_loss",
    "device",
    "started",
)
"""Sort keys of :func:`trial_page`; ``param:<name>`` sorts by a parameter as well."""


@dataclass(frozen=True)
class SweepOverview:
    """A sweep's record with its study's shape: state counts, best trial, parameter names.

    Attributes:
        info: The ``sm_sweeps`` record.
        study_id: Optuna's ``study_id`` of its study, or ``None`` if the study is missing.
        directions: ``"minimize"`` / ``"maximize"`` per objective (one for sweepmaster).
        counts: Number of trials per Optuna state name (states without trials absent).
        best_number: Number of the best COMPLETE trial (single objective), else ``None``.
        best_value: Its objective, else ``None``.
        param_names: Names of the sampled parameters, sorted (only by :func:`sweep_overview`).
    """

    info: SweepInfo
    study_id: int | None
    directions: tuple[str, ...]
    counts: dict[str, int]
    best_number: int | None
    best_value: float | None
    param_names: tuple[str, ...] = ()


@dataclass(frozen=True)
class TrialRecord:
    """One trial: Optuna's state, parameters and objective joined with its progress row.

    Attributes:
        number: Optuna's trial number.
        trial_id: Optuna's ``trial_id``.
        state: Optuna's state name (``RUNNING``, ``WAITING``, ``COMPLETE``, ``PRUNED``,
            ``FAIL``).
        params: Parameter values (Optuna's external representation) by name.
        objective: The first objective of a COMPLETE trial (may be infinite), else ``None``.
        datetime_start: When Optuna started it (aware UTC), if it did.
        datetime_complete: When it finished (aware UTC), if it did.
        step: Optimizer steps done (0 without a progress row).
        total_steps: Optimizer steps planned (0 without a progress row).
        tokens_per_s: Latest throughput in tokens/s.
        train_loss: Latest training loss.
        eval_loss: Latest evaluation loss.
        device: Where it trains or trained.
        failure_reason: Why it failed, from the progress row.
        checkpoint_path: Its saved weights, from the progress row.
        progress_id: Primary key of its progress row, if it has one.
        progress_started_at: When its progress row was (re)started (aware UTC).
        progress_updated_at: When its progress row was last written (aware UTC).
    """

    number: int
    trial_id: int
    state: str
    params: dict[str, Any]
    objective: float | None
    datetime_start: datetime | None
    datetime_complete: datetime | None
    step: int
    total_steps: int
    tokens_per_s: float | None
    train_loss: float | None
    eval_loss: float | None
    device: str | None
    failure_reason: str | None
    checkpoint_path: str | None
    progress_id: int | None
    progress_started_at: datetime | None
    progress_updated_at: datetime | None


@dataclass(frozen=True)
class Curve:
    """One recorded metric of a trial over optimizer steps (NaN where NaN was recorded).

    Attributes:
        name: Metric name, e.g. ``train_loss``.
        steps: Optimizer steps, ascending.
        values: The value at each step.
        num_points: Points recorded before any thinning.
    """

    name: str
    steps: list[int]
    values: list[float]
    num_points: int


@dataclass(frozen=True)
class TrialDetailRecord:
    """Everything the trial page shows about one trial.

    Attributes:
        trial: The table row of the trial.
        distributions: Each parameter's Optuna distribution as Optuna's JSON.
        intermediate_values: ``(step, value)`` reported to Optuna, by step.
        curves: Every recorded metric, by name.
        user_attrs: Optuna user attributes (JSON values).
        fail_reason: Optuna's failure reason system attribute, if set.
    """

    trial: TrialRecord
    distributions: dict[str, str]
    intermediate_values: list[tuple[int, float]]
    curves: list[Curve]
    user_attrs: dict[str, Any]
    fail_reason: str | None


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


def _utc(value: datetime | None) -> datetime | None:
    """Mark Optuna's naive UTC datetimes as UTC."""
    if value is None:
        return None
    return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value


def _text(column: ColumnElement[Any]) -> ColumnElement[str]:
    """Optuna's enum columns compared as text (a native enum type on PostgreSQL)."""
    return cast(column, String)


def _has_table(connection: Connection, name: str) -> bool:
    return inspect(connection).has_table(name)


def _objective(value: float | None, value_type: str | None) -> float | None:
    if value_type == "INF_POS":
        return math.inf
    if value_type == "INF_NEG":
        return -math.inf
    return value


def _intermediate_value(value: float | None, value_type: str) -> float:
    special = {"NAN": math.nan, "INF_POS": math.inf, "INF_NEG": -math.inf}
    return special[value_type] if value_type in special else float(value or 0.0)


@lru_cache(maxsize=4096)
def _distribution(distribution_json: str) -> BaseDistribution:
    return json_to_distribution(distribution_json)


def _external(value: float, distribution_json: str) -> Any:
    """Optuna's external representation of a stored parameter (e.g. a categorical's choice)."""
    return _distribution(distribution_json).to_external_repr(value)


# -- sweeps --------------------------------------------------------------------------------------
_SWEEP_COLUMNS = [getattr(Sweep, f) for f in SweepInfo.__dataclass_fields__ if f != "created"]


def _sweep_info(row: Any) -> SweepInfo:
    fields = [f for f in SweepInfo.__dataclass_fields__ if f != "created"]
    return SweepInfo(**{f: row._mapping[f] for f in fields})


def _best_per_study(
    connection: Connection, study_ids: Sequence[int], directions: dict[int, tuple[str, ...]]
) -> dict[int, tuple[int, float]]:
    """Best (number, value) of each single-objective study among ``study_ids``."""
    best: dict[int, tuple[int, float]] = {}
    for study_id in study_ids:
        dirs = directions.get(study_id, ())
        if len(dirs) != 1:
            continue
        order = _values.c.value.desc() if dirs[0] == "MAXIMIZE" else _values.c.value.asc()
        query = (
            select(_trials.c.number, _values.c.value, _text(_values.c.value_type))
            .join(_values, _values.c.trial_id == _trials.c.trial_id)
            .where(
                _trials.c.study_id == study_id,
                _text(_trials.c.state) == "COMPLETE",
                _values.c.objective == 0,
            )
        )
        # An infinite best value is stored as NULL with a value type; prefer it when it wins.
        inf_type = "INF_POS" if dirs[0] == "MAXIMIZE" else "INF_NEG"
        inf = connection.execute(
            query.where(_text(_values.c.value_type) == inf_type)
            .order_by(_trials.c.number)
            .limit(1)
        ).first()
        row = inf or connection.execute(
            query.where(_text(_values.c.value_type) == "FINITE")
            .order_by(order, _trials.c.number)
            .limit(1)
        ).first()
        if row is not None:
            value = _objective(row[1], row[2])
            assert value is not None
            best[study_id] = (row[0], value)
    return best


def _overviews(
    connection: Connection, where: ColumnElement[bool] | None, with_best: bool = True
) -> list[SweepOverview]:
    query = (
        select(*_SWEEP_COLUMNS, _studies.c.study_id)
        .outerjoin(_studies, _studies.c.study_name == Sweep.study_name)
        .order_by(Sweep.created_at, Sweep.id)
    )
    if where is not None:
        query = query.where(where)
    rows = connection.execute(query).all()
    study_ids = [r.study_id for r in rows if r.study_id is not None]
    counts: dict[int, dict[str, int]] = {sid: {} for sid in study_ids}
    directions: dict[int, tuple[str, ...]] = {}
    if study_ids:
        state = _text(_trials.c.state)
        count_query = (
            select(_trials.c.study_id, state, func.count())
            .where(_trials.c.study_id.in_(study_ids))
            .group_by(_trials.c.study_id, state)
        )
        for study_id, state_name, num in connection.execute(count_query):
            counts[study_id][state_name] = num
        dir_query = (
            select(_directions.c.study_id, _text(_directions.c.direction))
            .where(_directions.c.study_id.in_(study_ids))
            .order_by(_directions.c.study_id, _directions.c.objective)
        )
        listed: dict[int, list[str]] = {}
        for study_id, direction in connection.execute(dir_query):
            listed.setdefault(study_id, []).append(direction)
        directions = {k: tuple(v) for k, v in listed.items()}
    best = _best_per_study(connection, study_ids, directions) if with_best else {}
    overviews = []
    for row in rows:
        sid = row.study_id
        number, value = best.get(sid, (None, None)) if sid is not None else (None, None)
        overviews.append(
            SweepOverview(
                info=_sweep_info(row),
                study_id=sid,
                directions=tuple(d.lower() for d in directions.get(sid, ())),
                counts=counts.get(sid, {}) if sid is not None else {},
                best_number=number,
                best_value=value,
            )
        )
    return overviews


def _ready(connection: Connection) -> bool:
    """Whether both sweepmaster's and Optuna's tables exist (a fresh database has neither)."""
    return _has_table(connection, Sweep.__tablename__) and _has_table(connection, "trials")


def list_sweep_overviews(engine: Engine) -> list[SweepOverview]:
    """Return every sweep with its state counts and best trial, oldest first.

    Args:
        engine: An engine on the sweep database (never written).

    Returns:
        One overview per sweep (``param_names`` left empty); none on a database without
        sweepmaster's or Optuna's tables.
    """
    with engine.connect() as connection:
        if not _ready(connection):
            return []
        return _overviews(connection, None)


def sweep_overview(
    engine: Engine, name: str, *, with_best: bool = True, with_params: bool = True
) -> SweepOverview | None:
    """Return one sweep with its state counts, best trial and parameter names.

    Args:
        engine: An engine on the sweep database.
        name: The sweep's name.
        with_best: Look up the best trial (else ``best_*`` are ``None``).
        with_params: Look up the parameter names (else ``param_names`` is empty).

    Returns:
        The overview, or ``None`` when there is no such sweep.
    """
    with engine.connect() as connection:
        if not _ready(connection):
            return None
        found = _overviews(connection, Sweep.name == name, with_best)
        if not found:
            return None
        overview = found[0]
        if overview.study_id is None or not with_params:
            return overview
        names_query = (
            select(_params.c.param_name)
            .join(_trials, _trials.c.trial_id == _params.c.trial_id)
            .where(_trials.c.study_id == overview.study_id)
            .distinct()
        )
        names = sorted(connection.execute(names_query).scalars())
    return SweepOverview(**{**overview.__dict__, "param_names": tuple(names)})


# -- trial rows ----------------------------------------------------------------------------------
def _trial_select(sweep_id: int, study_id: int) -> Any:
    p = TrialProgress.__table__.c
    return (
        select(
            _trials.c.number,
            _trials.c.trial_id,
            _text(_trials.c.state).label("state"),
            _trials.c.datetime_start,
            _trials.c.datetime_complete,
            _values.c.value,
            _text(_values.c.value_type).label("value_type"),
            p.id.label("progress_id"),
            p.step,
            p.total_steps,
            TrialProgress.tokens_per_s,
            TrialProgress.train_loss,
            TrialProgress.eval_loss,
            p.device,
            p.failure_reason,
            p.checkpoint_path,
            TrialProgress.started_at,
            TrialProgress.updated_at,
        )
        .select_from(_trials)
        .outerjoin(
            _values, and_(_values.c.trial_id == _trials.c.trial_id, _values.c.objective == 0)
        )
        .outerjoin(
            TrialProgress,
            and_(
                TrialProgress.sweep_id == sweep_id,
                TrialProgress.trial_number == _trials.c.number,
            ),
        )
        .where(_trials.c.study_id == study_id)
    )


def _records(connection: Connection, rows: Sequence[Any]) -> list[TrialRecord]:
    params: dict[int, dict[str, Any]] = {row.trial_id: {} for row in rows}
    if params:
        query = select(
            _params.c.trial_id,
            _params.c.param_name,
            _params.c.param_value,
            _params.c.distribution_json,
        ).where(_params.c.trial_id.in_(list(params)))
        for trial_id, name, value, distribution_json in connection.execute(query):
            params[trial_id][name] = _external(value, distribution_json)
    return [
        TrialRecord(
            number=row.number,
            trial_id=row.trial_id,
            state=row.state,
            params=dict(sorted(params[row.trial_id].items())),
            objective=_objective(row.value, row.value_type) if row.value_type else None,
            datetime_start=_utc(row.datetime_start),
            datetime_complete=_utc(row.datetime_complete),
            step=row.step or 0,
            total_steps=row.total_steps or 0,
            tokens_per_s=row.tokens_per_s,
            train_loss=row.train_loss,
            eval_loss=row.eval_loss,
            device=row.device,
            failure_reason=row.failure_reason,
            checkpoint_path=row.checkpoint_path,
            progress_id=row.progress_id,
            progress_started_at=row.started_at,
            progress_updated_at=row.updated_at,
        )
        for row in rows
    ]


def _sort_column(key: str) -> tuple[ColumnElement[Any], Any]:
    """The ORDER BY expression of a sort key, and the parameter join it needs (or ``None``)."""
    columns: dict[str, Any] = {
        "number": _trials.c.number,
        "state": _text(_trials.c.state),
        "objective": _values.c.value,
        "step": TrialProgress.step,
        "progress": case(
            (TrialProgress.total_steps > 0, TrialProgress.step * 1.0 / TrialProgress.total_steps),
            else_=None,
        ),
        "tokens_per_s": TrialProgress.__table__.c.tokens_per_s,
        "train_loss": TrialProgress.__table__.c.train_loss,
        "eval_loss": TrialProgress.__table__.c.eval_loss,
        "device": TrialProgress.device,
        "started": _trials.c.datetime_start,
    }
    if key in columns:
        return columns[key], None
    if key.startswith("param:") and len(key) > len("param:"):
        alias = _params.alias("sort_param")
        return alias.c.param_value, alias
    raise ValueError(f"unknown sort key {key!r}: use one of {', '.join(SORT_KEYS)} or param:NAME")


def trial_page(
    engine: Engine,
    sweep_id: int,
    study_id: int,
    *,
    states: Sequence[str] = (),
    sort: str = "number",
    descending: bool = False,
    offset: int = 0,
    limit: int = 50,
) -> tuple[int, list[TrialRecord]]:
    """Return one page of a sweep's trial table, sorted and filtered in the database.

    Rows without a value for the sort key (a running trial's objective) come last in either
    order; ties are broken by trial number. A categorical parameter sorts by its choice index.

    Args:
        engine: An engine on the sweep database.
        sweep_id: The sweep's ``id``.
        study_id: Its Optuna ``study_id``.
        states: Only trials in these Optuna states; all when empty.
        sort: One of :data:`SORT_KEYS`, or ``param:<name>``.
        descending: Sort from high to low.
        offset: Rows to skip.
        limit: Most rows to return.

    Returns:
        ``(total, rows)``: the number of trials that match ``states``, and the page.

    Raises:
        ValueError: ``sort`` is not a sort key.
    """
    column, param_alias = _sort_column(sort)
    query = _trial_select(sweep_id, study_id)
    count = select(func.count()).select_from(_trials).where(_trials.c.study_id == study_id)
    if states:
        query = query.where(_text(_trials.c.state).in_(list(states)))
        count = count.where(_text(_trials.c.state).in_(list(states)))
    if param_alias is not None:
        query = query.outerjoin(
            param_alias,
            and_(
                param_alias.c.trial_id == _trials.c.trial_id,
                param_alias.c.param_name == sort[len("param:") :],
            ),
        )
    ordered = column.desc() if descending else column.asc()
    query = query.order_by(column.is_(None), ordered, _trials.c.number).offset(offset).limit(limit)
    with engine.connect() as connection:
        total = connection.execute(count).scalar_one()
        return total, _records(connection, connection.execute(query).all())


def trial_records(
    engine: Engine, sweep_id: int, study_id: int, numbers: Sequence[int]
) -> list[TrialRecord]:
    """Return the table rows of the given trials, by number.

    Args:
        engine: An engine on the sweep database.
        sweep_id: The sweep's ``id``.
        study_id: Its Optuna ``study_id``.
        numbers: Trial numbers; unknown numbers are left out.

    Returns:
        The rows that exist, ordered by trial number.
    """
    if not numbers:
        return []
    query = (
        _trial_select(sweep_id, study_id)
        .where(_trials.c.number.in_(list(numbers)))
        .order_by(_trials.c.number)
    )
    with engine.connect() as connection:
        return _records(connection, connection.execute(query).all())


@dataclass(frozen=True)
class TrialLinks:
    """What other records tell about some trials: the devices each ran on, and their retries.

    Attributes:
        devices: Per trial number, every device that ran one of its tasks (its own, or those of
            the fused array it was a member of), sorted; trials without tasks are absent.
        retried_by: Per trial number, the trial that runs it again after it was interrupted
            (sweepmaster's ``retry_of`` user attribute, or of a heartbeat retry the last
            entry of Optuna's ``retry_history`` system attribute, else its ``failed_trial``:
            a retry that was itself retried links to its own retry, not the series' first).
    """

    devices: dict[int, tuple[str, ...]]
    retried_by: dict[int, int]


#: Attributes naming the trial a retry repeats, the most direct last: (table, key).
_RETRY_ATTRS = ((_user_attrs, "retry_of"), (_system_attrs, "failed_trial"),
                (_system_attrs, "retry_history"))


def trial_links(
    engine: Engine, sweep_id: int, study_id: int, numbers: Sequence[int]
) -> TrialLinks:
    """Return the devices and the retries of the given trials.

    Args:
        engine: An engine on the sweep database.
        sweep_id: The sweep's ``id``.
        study_id: Its Optuna ``study_id``.
        numbers: Trial numbers.

    Returns:
        Their :class:`TrialLinks`.
    """
    wanted = set(numbers)
    devices: dict[int, set[str]] = {}
    retried_by: dict[int, int] = {}
    if not wanted:
        return TrialLinks({}, {})
    events, groups = TaskEventRow.__table__, FusionGroupMember.__table__
    e, g = events.c, groups.c
    with engine.connect() as connection:
        if _has_table(connection, TaskEventRow.__tablename__):
            own = select(e.trial_number, e.device).distinct().where(
                e.sweep_id == sweep_id, e.trial_number.in_(wanted))
            found = list(connection.execute(own))
            if _has_table(connection, FusionGroupMember.__tablename__):
                fused = select(g.trial_number, e.device).distinct().join(
                    groups, and_(g.sweep_id == e.sweep_id, g.job == e.job)
                ).where(e.sweep_id == sweep_id, g.trial_number.in_(wanted))
                found += list(connection.execute(fused))
            for number, device in found:
                devices.setdefault(number, set()).add(device)
        repeats: dict[int, int] = {}  # retry -> the trial it runs again (the most direct)
        for table, key in _RETRY_ATTRS:
            query = select(_trials.c.number, table.c.value_json).join(
                _trials, _trials.c.trial_id == table.c.trial_id
            ).where(_trials.c.study_id == study_id, table.c.key == key)
            for retry, value_json in connection.execute(query):
                try:
                    earlier = json.loads(value_json)
                except ValueError:
                    continue
                if isinstance(earlier, list) and earlier:  # retry_history: oldest first
                    earlier = earlier[-1]
                if isinstance(earlier, int) and earlier != retry:
                    repeats[retry] = earlier
        for retry, earlier in repeats.items():
            if earlier in wanted:
                retried_by[earlier] = min(retry, retried_by.get(earlier, retry))
    return TrialLinks({n: tuple(sorted(d)) for n, d in devices.items()}, retried_by)


def _thin(steps: list[int], values: list[float], max_points: int) -> tuple[list[int], list[float]]:
    """Keep at most ``max_points`` evenly spaced points, always the first and the last."""
    if len(steps) <= max_points or max_points < 2:
        return steps, values
    stride = (len(steps) - 1) / (max_points - 1)
    keep = sorted({round(i * stride) for i in range(max_points)})
    return [steps[i] for i in keep], [values[i] for i in keep]


def trial_detail(
    engine: Engine, sweep_id: int, study_id: int, number: int, max_points: int = 2000
) -> TrialDetailRecord | None:
    """Return one trial with its learning curves, intermediate values and attributes.

    Args:
        engine: An engine on the sweep database.
        sweep_id: The sweep's ``id``.
        study_id: Its Optuna ``study_id``.
        number: The trial's number.
        max_points: Most points per curve; longer curves are thinned evenly.

    Returns:
        The trial, or ``None`` when the study has no trial ``number``.
    """
    found = trial_records(engine, sweep_id, study_id, [number])
    if not found:
        return None
    trial = found[0]
    with engine.connect() as connection:
        dist_query = select(_params.c.param_name, _params.c.distribution_json).where(
            _params.c.trial_id == trial.trial_id
        )
        distributions: dict[str, str] = dict(connection.execute(dist_query).all())
        intermediate = [
            (step, _intermediate_value(value, value_type))
            for step, value, value_type in connection.execute(
                select(
                    _intermediates.c.step,
                    _intermediates.c.intermediate_value,
                    _text(_intermediates.c.intermediate_value_type),
                )
                .where(_intermediates.c.trial_id == trial.trial_id)
                .order_by(_intermediates.c.step)
            )
        ]
        user_attrs = {
            key: json.loads(value)
            for key, value in connection.execute(
                select(_user_attrs.c.key, _user_attrs.c.value_json).where(
                    _user_attrs.c.trial_id == trial.trial_id
                )
            )
        }
        fail_json = connection.execute(
            select(_system_attrs.c.value_json).where(
                _system_attrs.c.trial_id == trial.trial_id,
                _system_attrs.c.key == _FAIL_REASON_ATTR,
            )
        ).scalar()
        series: dict[str, tuple[list[int], list[float]]] = {}
        if trial.progress_id is not None:
            metric_rows = connection.execute(
                select(Metric.name, Metric.step, Metric.value)
                .where(Metric.trial_progress_id == trial.progress_id)
                .order_by(Metric.name, Metric.step, Metric.id)
            )
            for name, step, value in metric_rows:
                steps, values = series.setdefault(name, ([], []))
                steps.append(step)
                values.append(value)
    curves = []
    for name, (steps, values) in series.items():
        thin_steps, thin_values = _thin(steps, values, max_points)
        curves.append(Curve(name, thin_steps, thin_values, len(steps)))
    return TrialDetailRecord(
        trial=trial,
        distributions=distributions,
        intermediate_values=intermediate,
        curves=curves,
        user_attrs=user_attrs,
        fail_reason=None if fail_json is None else str(json.loads(fail_json)),
    )


# -- change detection (live updates) -------------------------------------------------------------
def active_trial_states(
    engine: Engine, study_id: int, completed_since: datetime
) -> list[tuple[int, str, datetime | None]]:
    """Return trials that are unfinished or finished at or after ``completed_since``.

    Args:
        engine: An engine on the sweep database.
        study_id: The Optuna ``study_id``.
        completed_since: Aware UTC time; finished trials completed earlier are left out.

    Returns:
        ``(number, state, datetime_complete)`` tuples.
    """
    since = completed_since.astimezone(timezone.utc).replace(tzinfo=None)
    query = select(
        _trials.c.number, _text(_trials.c.state), _trials.c.datetime_complete
    ).where(
        _trials.c.study_id == study_id,
        (_text(_trials.c.state).in_(["RUNNING", "WAITING"]))
        | (_trials.c.datetime_complete >= since),
    )
    with engine.connect() as connection:
        return [(n, s, _utc(d)) for n, s, d in connection.execute(query)]


def changed_progress(
    engine: Engine, sweep_id: int, updated_since: datetime
) -> list[tuple[int, datetime]]:
    """Return the progress rows of a sweep written at or after ``updated_since``.

    Args:
        engine: An engine on the sweep database.
        sweep_id: The sweep's ``id``.
        updated_since: Aware UTC time.

    Returns:
        ``(trial_number, updated_at)`` tuples.
    """
    query = select(TrialProgress.trial_number, TrialProgress.updated_at).where(
        TrialProgress.sweep_id == sweep_id, TrialProgress.updated_at >= updated_since
    )
    with engine.connect() as connection:
        return [(number, updated) for number, updated in connection.execute(query)]


# -- tables written by later executors -----------------------------------------------------------
def _optional_table(connection: Connection, name: str, required: Sequence[str]) -> Table | None:
    if not _has_table(connection, name):
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
