"""A sweep's identity: a launch joins only the study it created, configured as the file says.

:func:`check_identity` reads (never writes) the study of the sweep's name and the sweep's
record, and refuses a study that sweepmaster did not create, or a sweep recorded with another
direction, metric, search space or other setting, before a launch writes anything.
"""

from __future__ import annotations

import json
from typing import Any

import optuna
import sqlalchemy
import sqlalchemy.pool

from sweepmaster.config.schema import SweepConfig
from sweepmaster.errors import ConfigError, StorageError
from sweepmaster.store.engine import (
    first_line,
    guard_statements,
    masked_url,
    postgres_connect_args,
)
from sweepmaster.store.locks import schema_lock
from sweepmaster.store.retry import run_with_retry
from sweepmaster.study import TRIAL_HEARTBEAT_ATTR

__all__ = ["check_identity"]


def check_identity(config: SweepConfig, storage_url: str, recorded_text: str | None) -> None:
    """Check, reading only, that a launch of ``config`` may create or join its study.

    A study of the sweep's name that sweepmaster did not create (no sweep record of that
    name, and not made by :func:`~sweepmaster.study.open_study`: made with Optuna directly, or
    by another tool) is never adopted: its direction would override the file's and its trials
    would count toward the grid. A study made by :func:`~sweepmaster.study.open_study` that no
    launch recorded yet is joined when its direction is the file's. A sweep recorded with
    another ``study.direction``, ``study.metric`` or search space (``parameters``), or any
    other difference in its configuration, is refused too.

    Args:
        config: The sweep file.
        storage_url: The storage URL.
        recorded_text: The configuration text of the sweep record of the same name
            (``SweepInfo.config_text``), or ``None`` when there is none.

    Raises:
        ConfigError: The sweep is recorded with another direction, metric or search space
            (naming the key and the recorded value).
        StorageError: The study exists without a sweep record, or the recorded sweep differs
            in another setting (``"<file>: <dotted key>: ..."`` with both values), or the
            storage cannot be read.
    """
    shown = masked_url(storage_url)
    existing = _existing_study(config.name, storage_url)
    directions = existing[0] if existing else None
    if recorded_text is None:
        if existing is None:
            return
        if not existing[1]:
            raise StorageError(
                f"study {config.name!r} in {shown} was not created by sweepmaster for this "
                "sweep; give the sweep another name or use another --storage")
        if directions != [config.study.direction]:  # made by open_study, not launched yet
            raise ConfigError(
                config.source, "study.direction",
                f"study {config.name!r} already exists in {shown} with a different "
                f"configuration: it was created with {'/'.join(directions or [])!r}, not "
                f"{config.study.direction!r}; give the sweep a new name or use another --storage")
        return
    try:
        recorded = json.loads(recorded_text)
        theirs = {"study.direction": recorded["study"]["direction"],
                  "study.metric": recorded["study"]["metric"],
                  "parameters": recorded["parameters"]}
    except (ValueError, KeyError, TypeError):
        raise StorageError(f"sweep {config.name!r} in {shown} has a stored configuration "
                           "sweepmaster cannot read; give the sweep another name or use "
                           "another --storage") from None
    mine = json.loads(config.canonical_text())
    ours = {"study.direction": mine["study"]["direction"], "study.metric": mine["study"]["metric"],
            "parameters": mine["parameters"]}
    if directions is not None and directions != [theirs["study.direction"]]:
        theirs["study.direction"] = "/".join(directions)
    for key, value in ours.items():
        if value != theirs[key]:
            what = ("another search space" if key == "parameters"
                    else f"{theirs[key]!r}, not {value!r}")
            raise ConfigError(config.source, key,
                              f"sweep {config.name!r} already exists in {shown} with a different "
                              f"configuration: it was created with {what}; give the sweep a new "
                              "name or use another --storage")
    if recorded_text != config.canonical_text():
        difference = _first_difference(recorded, mine)
        key, was, now = difference or ("", None, None)
        what = (f": it was created with {key} {_shown(was)}, not {_shown(now)}; a sweep's "
                "settings other than resources make it another sweep" if difference else "")
        where = f"{config.source}: {key}: " if difference else ""
        raise StorageError(
            f"{where}sweep {config.name!r} already exists in {shown} with a different "
            f"configuration{what}; give the sweep a new name (--set name=...) or use another "
            "--storage")


_MISSING = object()


def _first_difference(recorded: object, mine: object,
                      key: str = "") -> tuple[str, object, object] | None:
    """The first dotted key whose value differs, with both values; ``None`` if none does."""
    if isinstance(recorded, dict) and isinstance(mine, dict):
        for name in sorted(set(recorded) | set(mine), key=str):
            found = _first_difference(recorded.get(name, _MISSING), mine.get(name, _MISSING),
                                      f"{key}.{name}" if key else str(name))
            if found is not None:
                return found
        return None
    if recorded == mine or not key:
        return None
    return key, recorded, mine


def _shown(value: object) -> str:
    """A value of a configuration for a message (``unset`` for a key one side lacks)."""
    if value is _MISSING:
        return "unset"
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _existing_study(name: str, storage_url: str) -> tuple[list[str], bool] | None:
    """The directions of the study ``name``, and whether sweepmaster made it; ``None``: none.

    Reads only: Optuna's storage is opened without creating tables or checking versions
    (:func:`~sweepmaster.store.migrate.check_optuna_schema` has checked them), under the schema
    lock since Optuna stamps its version table where another process has not yet.
    """
    shown = masked_url(storage_url)

    url = sqlalchemy.make_url(storage_url)
    engine_kwargs: dict[str, Any] = {"poolclass": sqlalchemy.pool.NullPool}
    if url.get_backend_name() == "postgresql":  # never waits forever on a silent network
        engine_kwargs["connect_args"] = postgres_connect_args(url)

    def read() -> tuple[list[str], bool] | None:
        engine = sqlalchemy.create_engine(storage_url, **engine_kwargs)
        guard_statements(engine)
        try:
            if not sqlalchemy.inspect(engine).has_table("studies"):
                return None
        finally:
            engine.dispose()
        # Optuna stamps its alembic version when it finds none (a database another process is
        # creating right now): under the schema lock, like every other creation.
        with schema_lock(storage_url):
            storage = optuna.storages.RDBStorage(storage_url, skip_compatibility_check=True,
                                                 skip_table_creation=True,
                                                 engine_kwargs=engine_kwargs)
        guard_statements(storage.engine)
        try:
            study_id = storage.get_study_id_from_name(name)
            directions = [d.name.lower() for d in storage.get_study_directions(study_id)]
            ours = TRIAL_HEARTBEAT_ATTR in storage.get_study_system_attrs(study_id)
        except KeyError:
            return None
        finally:
            storage.engine.dispose()
        return directions, ours

    try:
        return run_with_retry(read, f"read study {name!r}")
    except StorageError:
        raise
    except Exception as exc:  # driver errors of every kind
        raise StorageError(f"cannot read Optuna storage {shown}: {first_line(exc)}") from exc
