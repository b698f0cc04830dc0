"""sweepmaster's own tables: engine, Alembic migrations, progress recording and queries.

Optuna's tables live in the same database and are never touched here; sweepmaster's tables are
prefixed ``sm_`` and versioned in ``sweepmaster_alembic_version``.

The names below are imported on first use, so reading one setting
(:meth:`RetryPolicy.from_env`) does not pay for importing Alembic and the table models.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sweepmaster.lazy_exports import lazy_exports

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

__getattr__, __dir__, __all__ = lazy_exports(globals())
