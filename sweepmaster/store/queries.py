"""Repository functions over sweepmaster's tables: sweep records and read-only views.

Everything returned here is a frozen dataclass, never an ORM object, so callers outside
:mod:`sweepmaster.store` hold no session and can pass values across threads.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import datetime

import sqlalchemy.exc
from sqlalchemy import insert, select, update
from sqlalchemy.engine import Engine

from sweepmaster.errors import StorageError
from sweepmaster.runtime.events import TrialStatistics
from sweepmaster.store.models import SWEEP_STATUSES, Metric, Sweep, TrialProgress, utcnow
from sweepmaster.store.retry import RetryPolicy, run_with_retry

__all__ = [
    "SweepInfo",
    "TrialProgressRow",
    "config_hash",
    "get_or_create_sweep",
    "get_sweep",
    "list_sweeps",
    "metric_history",
    "set_sweep_status",
    "trial_progress",
]


@dataclass(frozen=True)
class SweepInfo:
    """One sweep's record.

    Attributes:
        id: Primary key in ``sm_sweeps``.
        name: The sweep's unique name.
        study_name: Name of its Optuna study (same storage URL).
        config_text: The ``sweep.yaml`` text the sweep was first launched with.
        config_hash: SHA-256 hex digest of ``config_text`` (:func:`config_hash`).
        status: ``running``, ``completed``, ``interrupted``, ``failed`` or ``incomplete``.
        created_at: When the record was created (timezone-aware UTC).
        updated_at: When the record last changed (timezone-aware UTC).
        created: Whether the call that returned this value created the record.
    """

    id: int
    name: str
    study_name: str
    config_text: str
    config_hash: str
    status: str
    created_at: datetime
    updated_at: datetime
    created: bool = False


@dataclass(frozen=True)
class TrialProgressRow(TrialStatistics):
    """Progress of one trial, as last flushed by a :class:`~sweepmaster.store.ProgressRecorder`.

    With the trial's statistics (:class:`~sweepmaster.runtime.events.TrialStatistics`:
    ``swap_bytes``, ``num_shards``, ...), keyword arguments.

    Attributes:
        id: Primary key in ``sm_trial_progress``.
        sweep_id: The sweep the trial belongs to.
        trial_number: Optuna's trial number (unique within the sweep).
        optuna_trial_id: Optuna's ``trial_id`` in its own tables, if known.
        state: ``RUNNING``, ``COMPLETE``, ``PRUNED`` or ``FAIL`` (Optuna's names).
        step: Optimizer steps done.
        total_steps: Optimizer steps planned.
        tokens_per_s: Recent training throughput in tokens/s; ``None`` before the first step.
        train_loss: Latest training loss (nats/token); ``None`` before the first step or if NaN.
        eval_loss: Latest evaluation loss (nats/token); ``None`` before the first evaluation or
            if NaN.
        objective: The value told to Optuna; ``None`` while running, for failed trials, or NaN.
        device: The device the trial trains on, e.g. ``"cuda:0"``.
        failure_reason: Why the trial failed, if it did.
        checkpoint_path: Where its final checkpoint was saved, if it was.
        started_at: When the (latest launch of the) trial started (timezone-aware UTC).
        updated_at: When the row was last written (timezone-aware UTC).
    """

    id: int
    sweep_id: int
    trial_number: int
    optuna_trial_id: int | None
    state: str
    step: int
    total_steps: int
    tokens_per_s: float | None
    train_loss: float | None
    eval_loss: float | None
    objective: float | None
    device: str
    failure_reason: str | None
    checkpoint_path: str | None
    started_at: datetime
    updated_at: datetime


def config_hash(config_text: str) -> str:
    """Return the SHA-256 hex digest of a sweep's configuration text (UTF-8).

    Args:
        config_text: The ``sweep.yaml`` text.

    Returns:
        64 lowercase hex characters.
    """
    return hashlib.sha256(config_text.encode("utf-8")).hexdigest()


# The selected columns are named like the dataclass fields, so rows convert with **row._asdict().
_SWEEP_COLUMNS = [getattr(Sweep, f) for f in SweepInfo.__dataclass_fields__ if f != "created"]
_PROGRESS_COLUMNS = [getattr(TrialProgress, f) for f in TrialProgressRow.__dataclass_fields__]


def get_sweep(engine: Engine, name: str) -> SweepInfo | None:
    """Return the sweep called ``name``.

    Args:
        engine: An engine on a database at head (:func:`~sweepmaster.store.upgrade_to_head`).
        name: The sweep's name.

    Returns:
        Its record, or ``None`` when there is no such sweep.
    """
    with engine.connect() as connection:
        row = connection.execute(select(*_SWEEP_COLUMNS).where(Sweep.name == name)).one_or_none()
    return None if row is None else SweepInfo(**row._asdict())


def get_or_create_sweep(engine: Engine, name: str, study_name: str, config_text: str,
                        retry: RetryPolicy | None = None) -> SweepInfo:
    """Return the sweep called ``name``, creating it (status ``running``) if there is none.

    An existing record is returned unchanged, even when ``study_name`` or ``config_text``
    differ from the stored ones: callers compare ``config_hash`` to decide whether a relaunch
    may resume. Safe against a concurrent creator of the same name, and retried through a
    short database outage (:mod:`sweepmaster.store.retry`).

    Args:
        engine: An engine on a database at head.
        name: The sweep's unique name.
        study_name: Name of its Optuna study.
        config_text: The ``sweep.yaml`` text; its SHA-256 is stored as ``config_hash``.
        retry: How long to retry; default from the environment (60 s).

    Returns:
        The record, with ``created=True`` if this call created it.

    Raises:
        StorageError: The database stayed unavailable longer than ``retry`` allows.
    """
    return run_with_retry(lambda: _get_or_create_sweep(engine, name, study_name, config_text),
                          f"record sweep {name!r}", retry)


def _get_or_create_sweep(engine: Engine, name: str, study_name: str,
                         config_text: str) -> SweepInfo:
    existing = get_sweep(engine, name)
    if existing is not None:
        return existing
    now = utcnow()
    try:
        with engine.begin() as connection:
            connection.execute(
                insert(Sweep).values(
                    name=name,
                    study_name=study_name,
                    config_text=config_text,
                    config_hash=config_hash(config_text),
                    status="running",
                    created_at=now,
                    updated_at=now,
                )
            )
    except sqlalchemy.exc.IntegrityError:
        existing = get_sweep(engine, name)  # another process created it first
        assert existing is not None
        return existing
    created = get_sweep(engine, name)
    assert created is not None
    return replace(created, created=True)


def set_sweep_status(engine: Engine, sweep_id: int, status: str,
                     retry: RetryPolicy | None = None) -> None:
    """Set a sweep's status (and its ``updated_at``), retried through a short outage.

    Args:
        engine: An engine on a database at head.
        sweep_id: The sweep's ``id``.
        status: ``running``, ``completed``, ``interrupted``, ``failed`` or ``incomplete``.
        retry: How long to retry; default from the environment (60 s).

    Raises:
        ValueError: ``status`` is not one of ``SWEEP_STATUSES``.
        StorageError: There is no sweep with that id, or the database stayed unavailable
            longer than ``retry`` allows.
    """
    if status not in SWEEP_STATUSES:
        allowed = ", ".join(SWEEP_STATUSES)
        raise ValueError(f"sweep status must be one of {allowed}, not {status!r}")

    def write() -> int:
        with engine.begin() as connection:
            return connection.execute(
                update(Sweep).where(Sweep.id == sweep_id)
                .values(status=status, updated_at=utcnow())
            ).rowcount

    if run_with_retry(write, f"set the status of sweep {sweep_id}", retry) == 0:
        raise StorageError(f"no sweep with id {sweep_id}")


def list_sweeps(engine: Engine) -> list[SweepInfo]:
    """Return every sweep, oldest first.

    Args:
        engine: An engine on a database at head.

    Returns:
        The records ordered by creation time.
    """
    with engine.connect() as connection:
        query = select(*_SWEEP_COLUMNS).order_by(Sweep.created_at, Sweep.id)
        rows = connection.execute(query).all()
    return [SweepInfo(**row._asdict()) for row in rows]


def trial_progress(engine: Engine, sweep_id: int) -> list[TrialProgressRow]:
    """Return the progress rows of a sweep's trials, by trial number.

    Args:
        engine: An engine on a database at head.
        sweep_id: The sweep's ``id``.

    Returns:
        One row per trial that was started, ordered by ``trial_number``.
    """
    query = (
        select(*_PROGRESS_COLUMNS)
        .where(TrialProgress.sweep_id == sweep_id)
        .order_by(TrialProgress.trial_number)
    )
    with engine.connect() as connection:
        rows = connection.execute(query).all()
    return [TrialProgressRow(**row._asdict()) for row in rows]


def metric_history(
    engine: Engine, sweep_id: int, trial_number: int, name: str | None = None
) -> list[tuple[int, str, float]]:
    """Return the recorded metrics of one trial, by step.

    Args:
        engine: An engine on a database at head.
        sweep_id: The sweep's ``id``.
        trial_number: The trial's number within the sweep.
        name: Only this metric (e.g. ``"train_loss"``, ``"lr"``, ``"tokens_per_s"``,
            ``"eval_loss"``, ``"eval_perplexity"``); all metrics when ``None``.

    Returns:
        ``(step, name, value)`` tuples ordered by step, then name, then insertion. A NaN that
        was recorded reads back as NaN. Empty for an unknown trial.
    """
    query = (
        select(Metric.step, Metric.name, Metric.value)
        .join(TrialProgress, Metric.trial_progress_id == TrialProgress.id)
        .where(TrialProgress.sweep_id == sweep_id, TrialProgress.trial_number == trial_number)
        .order_by(Metric.step, Metric.name, Metric.id)
    )
    if name is not None:
        query = query.where(Metric.name == name)
    with engine.connect() as connection:
        rows = connection.execute(query).all()
    return [(step, metric, value) for step, metric, value in rows]


def set_checkpoint_paths(engine: Engine, sweep_id: int, paths: Mapping[int, str | None],
                         retry: RetryPolicy | None = None) -> None:
    """Record where some trials' saved weights are now, or forget them (``None``).

    ``None`` is written before a trial's folder is deleted; a path when the folder moved.

    Args:
        engine: An engine on a database at head.
        sweep_id: The sweep's ``id``.
        paths: Trial number -> its new ``checkpoint_path``, or ``None`` to clear it.
        retry: How long to retry; default from the environment (60 s).

    Raises:
        StorageError: The database stayed unavailable longer than ``retry`` allows.
    """
    if not paths:
        return

    def write() -> None:
        with engine.begin() as connection:
            for number, path in sorted(paths.items()):
                connection.execute(update(TrialProgress)
                                   .where(TrialProgress.sweep_id == sweep_id,
                                          TrialProgress.trial_number == number)
                                   .values(checkpoint_path=path))

    run_with_retry(write, f"record the weights of trials {sorted(paths)}", retry)
