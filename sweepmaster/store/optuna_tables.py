"""Optuna's tables, declared once for reading them with SQLAlchemy Core.

Optuna's public API (``study.get_trials``) materializes every trial with all of its attributes,
which for a 10,000-trial sweep costs seconds (``bench/dashboard.py`` measures it); one page of
the dashboard's trial table needs about 50 rows, and ``status`` needs the devices and retries of
a few trials. So the queries that need speed read Optuna's tables directly, through the tables
declared here on a private :class:`~sqlalchemy.MetaData` that nothing ever creates, alters or
writes (only the columns sweepmaster reads). Their layout is Optuna's RDB storage schema
(unchanged from Optuna 3 through 5): enum columns hold the enum *names* (``'COMPLETE'``; a
native enum on PostgreSQL, hence :func:`as_text`) and datetimes are naive UTC (:func:`utc`).
"""

from __future__ import annotations

import math
from datetime import datetime, timezone
from functools import lru_cache
from typing import Any

import optuna
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
    cast,
    inspect,
)
from sqlalchemy.engine import Connection
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.types import TypeEngine

from sweepmaster.store.engine import make_read_only, read_only_url

__all__ = [
    "FAIL_REASON_ATTR",
    "as_text",
    "directions",
    "external_value",
    "has_table",
    "intermediate_value",
    "intermediates",
    "objective_value",
    "params",
    "read_only_storage",
    "studies",
    "system_attrs",
    "trials",
    "user_attrs",
    "utc",
    "values",
]

FAIL_REASON_ATTR = "fail_reason"
"""Optuna's system attribute of a failed trial's reason (``sweepmaster.study.FAIL_REASON_ATTR``,
which the store cannot import)."""

_metadata = MetaData()


_ColumnType = type[TypeEngine[Any]] | TypeEngine[Any]


def _table(name: str, **columns: _ColumnType) -> Table:
    """One of Optuna's tables with the columns read from it, by name and type."""
    return Table(name, _metadata, *(Column(c, type_) for c, type_ in columns.items()))


_KEY_VALUE: dict[str, _ColumnType] = {"trial_id": Integer, "key": String(512), "value_json": Text}

studies = _table("studies", study_id=Integer, study_name=String(512))
directions = _table("study_directions", study_id=Integer, direction=String(8), objective=Integer)
trials = _table("trials", trial_id=Integer, number=Integer, study_id=Integer, state=String(8),
                datetime_start=DateTime, datetime_complete=DateTime)
params = _table("trial_params", trial_id=Integer, param_name=String(512), param_value=Float,
                distribution_json=Text)
values = _table("trial_values", trial_id=Integer, objective=Integer, value=Float,
                value_type=String(8))
intermediates = _table("trial_intermediate_values", trial_id=Integer, step=Integer,
                       intermediate_value=Float, intermediate_value_type=String(8))
user_attrs = _table("trial_user_attributes", **_KEY_VALUE)
system_attrs = _table("trial_system_attributes", **_KEY_VALUE)


def utc(value: datetime | None) -> datetime | None:
    """Mark Optuna's naive UTC datetimes as UTC."""
    if value is None:
        return None
    return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value


def as_text(column: ColumnElement[Any]) -> ColumnElement[str]:
    """Optuna's enum columns compared as text (a native enum type on PostgreSQL)."""
    return cast(column, String)


def has_table(connection: Connection, name: str) -> bool:
    """Whether the database has table ``name`` (Optuna's, or an ``sm_`` table)."""
    return inspect(connection).has_table(name)


_SPECIAL = {"NAN": math.nan, "INF_POS": math.inf, "INF_NEG": -math.inf}


def objective_value(value: float | None, value_type: str | None) -> float | None:
    """A stored objective: infinities are ``NULL`` with their value type."""
    return _SPECIAL[value_type] if value_type in ("INF_POS", "INF_NEG") else value


def intermediate_value(value: float | None, value_type: str) -> float:
    """A stored intermediate value: NaN and infinities are ``NULL`` with their value type."""
    return _SPECIAL[value_type] if value_type in _SPECIAL else float(value or 0.0)


@lru_cache(maxsize=4096)
def _distribution(distribution_json: str) -> BaseDistribution:
    return json_to_distribution(distribution_json)


def external_value(value: float, distribution_json: str) -> Any:
    """Optuna's external representation of a stored parameter (e.g. a categorical's choice)."""
    return _distribution(distribution_json).to_external_repr(value)


def read_only_storage(url: str, **engine_kwargs: Any) -> optuna.storages.RDBStorage:
    """Optuna's own storage on ``url``, for a study that exists; it never writes.

    Opened through :func:`~sweepmaster.store.engine.read_only_url` and made read-only once
    Optuna has checked its schema (:func:`~sweepmaster.store.engine.make_read_only`): Optuna's
    tables are there, so neither table creation nor its version stamping writes anything.

    Args:
        url: A SQLAlchemy database URL holding Optuna's tables.
        **engine_kwargs: Passed to ``sqlalchemy.create_engine``.
    """
    storage = optuna.storages.RDBStorage(read_only_url(url), engine_kwargs=engine_kwargs,
                                         skip_table_creation=True)
    make_read_only(storage.engine)
    return storage
