"""Read-only queries behind the web dashboard: sweeps, trial tables, curves, device timelines.

The dashboard joins sweepmaster's ``sm_*`` tables with Optuna's own tables in the same database,
read through their one declaration (:mod:`sweepmaster.store.optuna_tables`) so that a page of
the trial table is selected, sorted and paged in the database. Every function takes an
:class:`~sqlalchemy.engine.Engine` and returns frozen dataclasses or plain values, never ORM
objects; nothing here writes. :func:`trial_links` lives in the store, which ``status`` reads
too.
"""

from __future__ import annotations

from sweepmaster.dashboard.queries._devices import (
    FUSION_GROUPS_OPTIONAL,
    TASK_EVENTS_OPTIONAL,
    FusionMember,
    TaskEvent,
    fusion_members,
    task_events,
)
from sweepmaster.dashboard.queries._sweeps import (
    SweepOverview,
    list_sweep_overviews,
    sweep_overview,
)
from sweepmaster.dashboard.queries._trials import (
    SORT_KEYS,
    Curve,
    TrialDetailRecord,
    TrialRecord,
    active_trial_states,
    changed_progress,
    trial_detail,
    trial_page,
    trial_records,
)
from sweepmaster.store.trial_links import TrialLinks, trial_links

__all__ = [
    "FUSION_GROUPS_OPTIONAL",
    "SORT_KEYS",
    "TASK_EVENTS_OPTIONAL",
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
