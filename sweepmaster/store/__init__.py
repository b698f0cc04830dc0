"""sweepmaster's own tables: engine, Alembic migrations, progress recording and queries.

Optuna's tables live in the same database and are never touched here; sweepmaster's tables are
prefixed ``sm_`` and versioned in ``sweepmaster_alembic_version``.

The names below are imported on first use, so reading one setting
(:meth:`RetryPolicy.from_env`) does not pay for importing Alembic and the table models.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sweepmaster.lazy import lazy_exports

if TYPE_CHECKING:
    from sweepmaster.store.engine import create_store_engine
    from sweepmaster.store.migrate import current_revision, head_revision, upgrade_to_head
    from sweepmaster.store.progress import ProgressRecorder
    from sweepmaster.store.queries import (
        SweepInfo,
        TrialProgressRow,
        config_hash,
        get_or_create_sweep,
        get_sweep,
        list_sweeps,
        metric_history,
        set_checkpoint_paths,
        set_sweep_status,
        trial_progress,
    )
    from sweepmaster.store.retry import RetryPolicy, is_transient, run_with_retry
    from sweepmaster.store.timeline import TaskEventRecorder

_MODULES = {
    "create_store_engine": "engine", "current_revision": "migrate", "head_revision": "migrate",
    "upgrade_to_head": "migrate", "ProgressRecorder": "progress", "SweepInfo": "queries",
    "TrialProgressRow": "queries", "set_checkpoint_paths": "queries",
    "config_hash": "queries", "get_or_create_sweep": "queries", "get_sweep": "queries",
    "list_sweeps": "queries", "metric_history": "queries", "set_sweep_status": "queries",
    "trial_progress": "queries", "RetryPolicy": "retry", "is_transient": "retry",
    "run_with_retry": "retry", "TaskEventRecorder": "timeline",
}

__all__ = [
    "ProgressRecorder",
    "RetryPolicy",
    "SweepInfo",
    "TaskEventRecorder",
    "TrialProgressRow",
    "config_hash",
    "create_store_engine",
    "current_revision",
    "get_or_create_sweep",
    "get_sweep",
    "head_revision",
    "is_transient",
    "list_sweeps",
    "metric_history",
    "run_with_retry",
    "set_checkpoint_paths",
    "set_sweep_status",
    "trial_progress",
    "upgrade_to_head",
]

__getattr__, __dir__ = lazy_exports(
    __name__, {name: f"{__name__}.{module}" for name, module in _MODULES.items()}, globals())
