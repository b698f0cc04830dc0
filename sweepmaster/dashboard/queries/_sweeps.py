"""The dashboard's sweeps: each sweep's record joined with its study's counts and best trial."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.sql.elements import ColumnElement

from sweepmaster.store import optuna_tables as ot
from sweepmaster.store.models import Sweep
from sweepmaster.store.queries import SweepInfo

__all__ = [
    "SweepOverview",
    "list_sweep_overviews",
    "sweep_overview",
]


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
        order = ot.values.c.value.desc() if dirs[0] == "MAXIMIZE" else ot.values.c.value.asc()
        query = (
            select(ot.trials.c.number, ot.values.c.value, ot.as_text(ot.values.c.value_type))
            .join(ot.values, ot.values.c.trial_id == ot.trials.c.trial_id)
            .where(
                ot.trials.c.study_id == study_id,
                ot.as_text(ot.trials.c.state) == "COMPLETE",
                ot.values.c.objective == 0,
            )
        )
        # An infinite best value is stored as NULL with a value type; prefer it when it wins.
        inf_type = "INF_POS" if dirs[0] == "MAXIMIZE" else "INF_NEG"
        inf = connection.execute(
            query.where(ot.as_text(ot.values.c.value_type) == inf_type)
            .order_by(ot.trials.c.number)
            .limit(1)
        ).first()
        row = inf or connection.execute(
            query.where(ot.as_text(ot.values.c.value_type) == "FINITE")
            .order_by(order, ot.trials.c.number)
            .limit(1)
        ).first()
        if row is not None:
            value = ot.objective_value(row[1], row[2])
            assert value is not None
            best[study_id] = (row[0], value)
    return best


def _overviews(
    connection: Connection, where: ColumnElement[bool] | None, with_best: bool = True
) -> list[SweepOverview]:
    query = (
        select(*_SWEEP_COLUMNS, ot.studies.c.study_id)
        .outerjoin(ot.studies, ot.studies.c.study_name == Sweep.study_name)
        .order_by(Sweep.created_at, Sweep.id)
    )
    if where is not None:
        query = query.where(where)
    rows = connection.execute(query).all()
    study_ids = [r.study_id for r in rows if r.study_id is not None]
    counts: dict[int, dict[str, int]] = {sid: {} for sid in study_ids}
    directions: dict[int, tuple[str, ...]] = {}
    if study_ids:
        state = ot.as_text(ot.trials.c.state)
        count_query = (
            select(ot.trials.c.study_id, state, func.count())
            .where(ot.trials.c.study_id.in_(study_ids))
            .group_by(ot.trials.c.study_id, state)
        )
        for study_id, state_name, num in connection.execute(count_query):
            counts[study_id][state_name] = num
        dir_query = (
            select(ot.directions.c.study_id, ot.as_text(ot.directions.c.direction))
            .where(ot.directions.c.study_id.in_(study_ids))
            .order_by(ot.directions.c.study_id, ot.directions.c.objective)
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
    return ot.has_table(connection, Sweep.__tablename__) and ot.has_table(connection, "trials")


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
            select(ot.params.c.param_name)
            .join(ot.trials, ot.trials.c.trial_id == ot.params.c.trial_id)
            .where(ot.trials.c.study_id == overview.study_id)
            .distinct()
        )
        names = sorted(connection.execute(names_query).scalars())
    return SweepOverview(**{**overview.__dict__, "param_names": tuple(names)})
