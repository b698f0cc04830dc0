"""The dashboard's trial table and trial page: Optuna's trials joined with their progress rows.

A page of the table is selected, filtered, sorted and paged in the database (one page needs
about 50 rows of a sweep's thousands); a trial's curves are thinned to a number of points.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import and_, case, func, select
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.sql.elements import ColumnElement

from sweepmaster.store import optuna_tables as ot
from sweepmaster.store.models import Metric, TrialProgress

__all__ = [
    "SORT_KEYS",
    "Curve",
    "TrialDetailRecord",
    "TrialRecord",
    "active_trial_states",
    "changed_progress",
    "trial_detail",
    "trial_page",
    "trial_records",
]


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


# -- trial rows ----------------------------------------------------------------------------------
def _trial_select(sweep_id: int, study_id: int) -> Any:
    p = TrialProgress.__table__.c
    return (
        select(
            ot.trials.c.number,
            ot.trials.c.trial_id,
            ot.as_text(ot.trials.c.state).label("state"),
            ot.trials.c.datetime_start,
            ot.trials.c.datetime_complete,
            ot.values.c.value,
            ot.as_text(ot.values.c.value_type).label("value_type"),
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
        .select_from(ot.trials)
        .outerjoin(
            ot.values,
            and_(ot.values.c.trial_id == ot.trials.c.trial_id, ot.values.c.objective == 0),
        )
        .outerjoin(
            TrialProgress,
            and_(
                TrialProgress.sweep_id == sweep_id,
                TrialProgress.trial_number == ot.trials.c.number,
            ),
        )
        .where(ot.trials.c.study_id == study_id)
    )


def _records(connection: Connection, rows: Sequence[Any]) -> list[TrialRecord]:
    params: dict[int, dict[str, Any]] = {row.trial_id: {} for row in rows}
    if params:
        query = select(
            ot.params.c.trial_id,
            ot.params.c.param_name,
            ot.params.c.param_value,
            ot.params.c.distribution_json,
        ).where(ot.params.c.trial_id.in_(list(params)))
        for trial_id, name, value, distribution_json in connection.execute(query):
            params[trial_id][name] = ot.external_value(value, distribution_json)
    return [
        TrialRecord(
            number=row.number,
            trial_id=row.trial_id,
            state=row.state,
            params=dict(sorted(params[row.trial_id].items())),
            objective=ot.objective_value(row.value, row.value_type) if row.value_type else None,
            datetime_start=ot.utc(row.datetime_start),
            datetime_complete=ot.utc(row.datetime_complete),
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
        "number": ot.trials.c.number,
        "state": ot.as_text(ot.trials.c.state),
        "objective": ot.values.c.value,
        "step": TrialProgress.step,
        "progress": case(
            (TrialProgress.total_steps > 0, TrialProgress.step * 1.0 / TrialProgress.total_steps),
            else_=None,
        ),
        "tokens_per_s": TrialProgress.__table__.c.tokens_per_s,
        "train_loss": TrialProgress.__table__.c.train_loss,
        "eval_loss": TrialProgress.__table__.c.eval_loss,
        "device": TrialProgress.device,
        "started": ot.trials.c.datetime_start,
    }
    if key in columns:
        return columns[key], None
    if key.startswith("param:") and len(key) > len("param:"):
        alias = ot.params.alias("sort_param")
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
    count = select(func.count()).select_from(ot.trials).where(ot.trials.c.study_id == study_id)
    if states:
        query = query.where(ot.as_text(ot.trials.c.state).in_(list(states)))
        count = count.where(ot.as_text(ot.trials.c.state).in_(list(states)))
    if param_alias is not None:
        query = query.outerjoin(
            param_alias,
            and_(
                param_alias.c.trial_id == ot.trials.c.trial_id,
                param_alias.c.param_name == sort[len("param:") :],
            ),
        )
    ordered = column.desc() if descending else column.asc()
    query = query.order_by(column.is_(None), ordered, ot.trials.c.number)
    query = query.offset(offset).limit(limit)
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
        .where(ot.trials.c.number.in_(list(numbers)))
        .order_by(ot.trials.c.number)
    )
    with engine.connect() as connection:
        return _records(connection, connection.execute(query).all())


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
        dist_query = select(ot.params.c.param_name, ot.params.c.distribution_json).where(
            ot.params.c.trial_id == trial.trial_id
        )
        distributions: dict[str, str] = dict(connection.execute(dist_query).all())
        intermediate = [
            (step, ot.intermediate_value(value, value_type))
            for step, value, value_type in connection.execute(
                select(
                    ot.intermediates.c.step,
                    ot.intermediates.c.intermediate_value,
                    ot.as_text(ot.intermediates.c.intermediate_value_type),
                )
                .where(ot.intermediates.c.trial_id == trial.trial_id)
                .order_by(ot.intermediates.c.step)
            )
        ]
        user_attrs = {
            key: json.loads(value)
            for key, value in connection.execute(
                select(ot.user_attrs.c.key, ot.user_attrs.c.value_json).where(
                    ot.user_attrs.c.trial_id == trial.trial_id
                )
            )
        }
        fail_json = connection.execute(
            select(ot.system_attrs.c.value_json).where(
                ot.system_attrs.c.trial_id == trial.trial_id,
                ot.system_attrs.c.key == ot.FAIL_REASON_ATTR,
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
        ot.trials.c.number, ot.as_text(ot.trials.c.state), ot.trials.c.datetime_complete
    ).where(
        ot.trials.c.study_id == study_id,
        (ot.as_text(ot.trials.c.state).in_(["RUNNING", "WAITING"]))
        | (ot.trials.c.datetime_complete >= since),
    )
    with engine.connect() as connection:
        return [(n, s, ot.utc(d)) for n, s, d in connection.execute(query)]


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
