"""A sweep's launch: config -> study -> jobs -> executor -> results, and what it keeps.

Workers, resume after a crash, the sweep's identity, kept final weights, results and their
export, trackers, and the Optuna-objective :class:`Executor`. Names are imported on first use
(:mod:`sweepmaster.lazy_exports`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sweepmaster.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from sweepmaster.sweep.objective import Executor
    from sweepmaster.sweep.observer import SweepObserver
    from sweepmaster.sweep.plan import PlannedJob, SweepPlan, plan_sweep
    from sweepmaster.sweep.results import SweepResults, TrialRow, load_results
    from sweepmaster.sweep.run import SweepOutcome, run_sweep

__getattr__, __dir__, __all__ = lazy_exports(globals())
