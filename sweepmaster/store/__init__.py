"""sweepmaster's own tables: engine, Alembic migrations, progress recording and queries.

Optuna's tables live in the same database and are never touched here; sweepmaster's tables are
prefixed ``sm_`` and versioned in ``sweepmaster_alembic_version``.
"""

from __future__ import annotations

from sweepmaster.store.engine import create_store_engine
from sweepmaster.store.migrate import current_revision, head_revision, upgrade_to_head
from sweepmaster.store.progress import ProgressRecorder
from sweepmaster.store.queries import (
    SweepInfo,
    TrialProgressRow,
    clear_checkpoint_paths,
    config_hash,
    get_or_create_sweep,
    get_sweep,
    list_sweeps,
    metric_history,
    set_sweep_status,
    trial_progress,
)
from sweepmaster.store.retry import RetryPolicy, is_transient, run_with_retry
from sweepmaster.store.timeline import TaskEventRecorder

__all__ = [
    "ProgressRecorder",
    "RetryPolicy",
    "SweepInfo",
    "TaskEventRecorder",
    "TrialProgressRow",
    "clear_checkpoint_paths",
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
    "set_sweep_status",
    "trial_progress",
    "upgrade_to_head",
]
